/* bitserve's CPU kernels: the exported structs and functions.

   Python reads this file as its cffi `cdef` (lines starting with '#' dropped), so these
   declarations are the one statement of every signature and struct layout; keep them
   plain C that cffi parses (no macros). Pointers are raw tensor data; every tensor is
   contiguous fp32 unless said otherwise. */
#ifndef BITSERVE_H
#define BITSERVE_H
#include <stdint.h>

/* One linear layer's weights as a decode layer reads them.
   kind 0: fp32, data [N, K];
   kind 3: fp32 packed by bs_pack, data [N / 16][K][16] (N a multiple of 16);
   kind 1: int8 rows, data [N, K] int8, W = q * scale[n];
   kind 2: int4 groups, data the tiles of Int4Linear.tiled(), s4 their bf16 scales and
           zeros (W = (q - 8) * s + z), K padded to Kp, `group` columns a group; with
           `scale` set instead of s4, the same scales and zeros in fp32 (AWQ/GPTQ's fp16
           carried exactly); `perm` or NULL: column k of the codes meets x[perm[k]]
           (GPTQ act-order, its groups made contiguous);
   kind 5: bf16, data the panels of bs_bf16_pack (bf16.c).
   wsum, a8_rows (int8 only): each row's sum of q, and from how many rows of x on the
   activations are quantized too (VNNI); wsum NULL: never. bias [N] or NULL.
   lora_a (fp32 kinds only) or NULL: LoRA deltas after the product, bs_lora_add's, each
   row m with lora_slots[m] >= 0 through lora_a [lora_S, lora_W, K], lora_bt [.., N].
   kind 4: llama.cpp's blocks as a GGUF file stores them (ggml.c): `parts` points to
   `nparts` GgmlPart (below), their rows in order making the N outputs. */
typedef struct {
    long kind;
    const void *data;
    const float *scale;
    const uint16_t *s4;
    const float *bias;
    long N, K, Kp, group;
    const int32_t *wsum;
    long a8_rows;
    const float *lora_a, *lora_bt;
    const int *lora_slots;
    long lora_S, lora_W;
    const int32_t *perm;
    const void *parts;
    long nparts;
} Weight;

/* One decoder layer (Llama and the families that share its shape). Norm pointers are
   the multipliers (Gemma's 1 + w computed by the caller); qnorm, knorm (Qwen3, Gemma 3):
   an RMSNorm over each q and k head before RoPE, or NULL; post_attn, post_mlp (Gemma's
   sandwich norms): an RMSNorm of the attention and MLP outputs before they are added, or
   NULL. kpool, vpool: [Hkv, nblk, bs, D]; cos, sin: [max_len, D]. act: 0 SiLU (SwiGLU),
   1 tanh-GELU (GeGLU). window > 0: attend to the last `window` keys only; softcap > 0:
   scores become softcap * tanh(score / softcap) (Gemma 2). */
typedef struct {
    Weight qkv, o, gu, down;
    const float *ln1, *ln2, *qnorm, *knorm, *post_attn, *post_mlp;
    float *kpool, *vpool;
    const float *cos, *sin;
    long H, Hq, Hkv, D, I, nblk, bs, window, act;
    float eps, scale, softcap;
} LayerParams;

/* y [M, N] = x [M, K] (row stride ldx) @ w [N, K].T + b (b may be NULL) */
void bs_linear(const float *x, long ldx, long M, long K, const float *w, long N, const float *b,
               float *y);

/* P [N / 16][K][16] = w [N, K] in panels of 16 output rows (N a multiple of 16) */
void bs_pack(const float *w, long N, long K, float *P);

/* y [M, N] = x [M, K] (row stride ldx) @ W.T + b for W packed by bs_pack; b may be NULL */
void bs_linear_packed(const float *x, long ldx, long M, long K, const float *P, long N,
                      const float *b, float *y);

/* 1 when bs_linear_packed runs its vectorised tiles, 0 where it falls back to a plain
   loop (no AVX-512 at build time): only then does it beat a BLAS */
int bs_packed_vectorised(void);

/* How many threads (the caller and n - 1 pool workers) the packed GEMM and the decode
   attention may use (default 1) */
void bs_set_threads(long n);

/* y [M, N] = x [M, K] (row stride ldx) @ W.T + bias, for any kind of Weight */
void bs_gemv(const Weight *w, const float *x, long ldx, long M, float *y);

/* Decode attention for sequence i in row rows[i] of q and out ([T, Hq, D]); tables
   [B, max_blocks] int32; lens[i]: its context length, new token included (already in the
   pool). Rows not listed are left alone. */
void bs_paged_decode(const float *q, float *out, const int *rows, long B, long Hq, long Hkv,
                     long D, const float *kpool, const float *vpool, long nblk, long bs,
                     const int *tables, long max_blocks, const int *lens, float scale,
                     long window, float softcap);

/* One decoder layer for M decode rows, in place on the residual stream x [M, H]: the same
   arithmetic, in the same order, as the torch path. positions, slots: int64 [M]; rows,
   tables, max_blocks, lens: as bs_paged_decode's; scratch: at least
   M * (2H + 2 Hq D + 2 Hkv D + 3 I) floats. */
void bs_decode_layer(const LayerParams *p, float *x, long M, const int64_t *positions,
                     const int64_t *slots, const int *rows, const int *tables, long max_blocks,
                     const int *lens, float *scratch);

/* out [M, I] = silu(gu[:, :I]) * gu[:, I:] */
void bs_silu_mul(const float *gu, long M, long I, float *out);

/* RoPE in place on the H heads of D at the start of each of T rows of x (row stride ld) */
void bs_rope_rows(float *x, long T, long ld, long H, long D, const int64_t *positions,
                  const float *cos, const float *sin);

/* LoRA (lora.c): y[m] (row stride ldy) += Bt[s]^T (A[s] x[m]) for each row m of x [M, K]
   (row stride ldx) whose slot s = slots[m] is >= 0; A [S, W, K], Bt [S, W, N] */
void bs_lora_add(const float *x, long ldx, long M, long K, const int *slots, const float *A,
                 const float *Bt, long S, long W, long N, float *y, long ldy);

/* bf16 weights (bf16.c): P = w [N, K] bf16 in panels of 16 output rows, column pairs
   interleaved, [ceil(N / 16)][ceil(K / 2)][16][2], zero-padded */
void bs_bf16_pack(const uint16_t *w, long N, long K, uint16_t *P);

/* The bf16 product's inner loop: 1 vdpbf16ps (x rounded to bf16), 0 bf16 widened to fp32
   in registers and FMA (x exact); mode < 0 only asks. Returns the mode in effect (0
   where the build has no avx512_bf16). */
long bs_bf16_mode(long mode);

/* The compiler's layout of the structs above, for the test that holds cffi's to it:
   offsetof(type, field), or sizeof(type) for field "", or -1 if not listed. */
long bs_layout(const char *type, const char *field);

/* llama.cpp's weight formats (ggml.c). A GgmlPart is `rows` consecutive output rows of one
   ggml type (0 F32, 1 F16, 30 BF16, 2 Q4_0, 6 Q5_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K),
   `data` each row's blocks back to back, bs_ggml_row_bytes(type, K) bytes a row. One
   Weight may hold parts of different types (a fused qkv of Q4_K q, k and Q6_K v).
   `tiles` NULL: fp32 activations meet the blocks dequantized on the fly. Else int8
   activations (the default, ggml.c's "a8"): `tiles` the same codes as bs_ggml_a8_pack lays
   them out (`bits` 4 or 8 a code, tiles of 16 rows), `sz` their fp32 scale and offset
   per `group` (16 or 32) columns. */
typedef struct {
    long type, rows;
    const void *data;
    const uint8_t *tiles;
    const float *sz;
    long group, bits;
} GgmlPart;

/* bytes of one row of K weights of `type`; -1: not a type ggml.c reads, or K not a whole
   number of its blocks */
long bs_ggml_row_bytes(long type, long K);

/* out [rows, K] fp32 = the rows of `type` at data, dequantized as llama.cpp does */
void bs_ggml_dequantize(long type, const void *data, long rows, long K, float *out);

/* The a8 layout of `rows` rows of `type` (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): fills
   *group and *bits and returns the bytes of the tiles; with tiles and sz not NULL (sizes
   from a first call: sz is rows16 / 16 * K / group * 32 floats), writes them. The codes
   are the file's own, each weight w = sz scale * code + sz offset of its group (llama.cpp's
   value up to fp32 rounding). Returns -1 for a type it does not take. */
long bs_ggml_a8_pack(long type, const void *data, long rows, long K, uint8_t *tiles, float *sz,
                     long *group, long *bits);

/* out [rows, K] fp32 = a part's weights read back from its tiles (scale * code + offset) */
void bs_ggml_a8_dequantize(const uint8_t *tiles, const float *sz, long rows, long K, long group,
                           long bits, float *out);

/* y [M, N] int32 = x [M, K] int8 (row stride ldx) @ w [N, K] int8 .T, exactly (torch._int_mm's
   sums); wsum [N]: each row of w's sum (qgemm.c's int8 GEMM, VNNI where built) */
void bs_i8_gemm(const int8_t *x, long ldx, long M, long K, const int8_t *w, const int32_t *wsum,
                long N, int32_t *y);

/* bench only: `iters` passes of 12 independent chains of one instruction (0 vpdpbusd,
   1 vdpbf16ps, 2 vfmadd231ps, all 512-bit; multiply-adds a pass: 768, 384, 192), so
   MACs / seconds is this core's peak; returns -1 where the build lacks the instruction */
long bs_isa_peak(long kind, long iters);

/* y [M, N] = x [M, K] (row stride ldx) @ W.T + bias for a kind 4 Weight */
void bs_ggml_gemv(const Weight *w, const float *x, long ldx, long M, float *y);

#endif
