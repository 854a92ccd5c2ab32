/* llama.cpp's weight formats, read as the GGUF file stores them (`Weight` kind 4).

   A GGUF tensor of type Q4_0, Q5_0, Q8_0 (blocks of 32 weights, an fp16 scale each) or
   Q4_K, Q5_K, Q6_K (super-blocks of 256: an fp16 scale, for Q4_K/Q5_K an fp16 min too,
   and 6- or 8-bit scales per 16 or 32 weights) is kept byte for byte, each row its blocks
   back to back, and these kernels dequantize it on the fly into fp32 and meet fp32
   activations with FMAs. So y equals x @ W.T for W as llama.cpp dequantizes it
   (`dequantize_row_*` in ggml-quants.c, gguf-py's `gguf.quants.dequantize`) up to fp32
   summation order; nothing is re-quantized, neither the weights nor x.

   Invariants: every row of a part starts on a block boundary (row bytes = K / block
   elements * block bytes); a weight's value depends only on its own block; the
   dequantization of a block is the same whichever kernel path reads it.

   - Up to 8 rows of x (decode, M < PANEL_ROWS): a weight row is dequantized in
     registers, 16 weights at a time, each vector FMA'd straight into every row of x
     (AVX-512; without it, and for F32/F16/BF16 parts, through an L1 buffer and `dot`).
     At 4-8 rows this is 1.5-2x the panels below; at 16 rows the two are even.
   - More rows (batched decode, prefill): CHUNK output rows at a time are dequantized
     into an L2 buffer, transposed into bs_pack's panels (16 x 16 blocks in registers)
     and run through the packed fp32 GEMM against every row of x, so dequantization is
     paid once per weight per call, not once per row of x. (bs_linear_packed called
     from a pool task runs on that thread: the pool does not nest.)
   - The default (`gguf_activations = "int8"`, a part with `tiles`): int8 activations,
     llama.cpp's own scheme, on the codes repacked once at load (see "a8" below), every
     row count. At 16 rows the two fp32 paths above are bound by fp32 FMAs (16
     multiply-adds an instruction) at 3-5x the int4 kernel's time; this one runs VNNI
     (64) at 1.0-1.4x it.
   Each splits the output rows over the thread pool in chunks of CHUNK rows; each
   thread keeps its own scratch (thread-local, grown once, never freed). */
#include "internal.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

#define CHUNK 32      /* output rows a task (two packed panels) */
#define PANEL_ROWS 9  /* from this many rows of x on, the panel path */

/* IEEE half -> float, exactly (normals, subnormals, inf, nan): one instruction with F16C */
static inline float fp16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    union { uint32_t u; float f; } c;
    if (exp == 31) {
        c.u = sign | 0x7f800000u | man << 13;
    } else if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        c.f = (float)man * 5.9604644775390625e-8f;
        c.u |= sign;
    } else {
        c.u = sign | (exp + 112) << 23 | man << 13;
    }
    return c.f;
}

/* (elements, bytes) of one block of `type`; 0 elements: not a type these kernels read */
static void block_shape(long type, long *elems, long *bytes) {
    *elems = 0, *bytes = 0;
    switch (type) {
    case T_F32: *elems = 1, *bytes = 4; break;
    case T_F16: case T_BF16: *elems = 1, *bytes = 2; break;
    case T_Q4_0: *elems = 32, *bytes = 18; break;
    case T_Q5_0: *elems = 32, *bytes = 22; break;
    case T_Q8_0: *elems = 32, *bytes = 34; break;
    case T_Q4_K: *elems = 256, *bytes = 144; break;
    case T_Q5_K: *elems = 256, *bytes = 176; break;
    case T_Q6_K: *elems = 256, *bytes = 210; break;
    }
}

long bs_ggml_row_bytes(long type, long K) {
    long elems, bytes;
    block_shape(type, &elems, &bytes);
    if (elems == 0 || K % elems) return -1;
    return K / elems * bytes;
}

/* -- one block -> fp32, as ggml-quants.c's dequantize_row_* computes each value --------- */
static void deq_q4_0(const uint8_t *b, float *y) { /* d, qs[16]: low nibbles, then high */
    float d = fp16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q5_0(const uint8_t *b, float *y) { /* d, qh (32 fifth bits), qs[16] */
    float d = fp16(b);
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                  (uint32_t)b[5] << 24;
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (float)(((qs[j] & 15) | h0) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | h1) - 16) * d;
    }
}

static void deq_q8_0(const uint8_t *b, float *y) { /* d, int8 qs[32] */
    float d = fp16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* Q4_K/Q5_K: 8 sub-blocks of 32, each a 6-bit scale and min packed in scales[12] */
static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63), *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void deq_q4_k(const uint8_t *b, float *y) { /* d, dmin, scales[12], qs[128] */
    float d = fp16(b), dmin = fp16(b + 2), sc, m;
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32, y += 64) {
        scale_min_k4(2 * j, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * j + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) {
            y[l] = d1 * (float)(q[l] & 15) - m1;
            y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

static void deq_q5_k(const uint8_t *b, float *y) { /* d, dmin, scales[12], qh[32], qs[128] */
    float d = fp16(b), dmin = fp16(b + 2), sc, m;
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int j = 0; j < 4; j++, q += 32, y += 64) {
        scale_min_k4(2 * j, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * j + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        int u1 = 1 << (2 * j), u2 = 2 << (2 * j);
        for (int l = 0; l < 32; l++) {
            y[l] = d1 * (float)((q[l] & 15) + (qh[l] & u1 ? 16 : 0)) - m1;
            y[l + 32] = d2 * (float)((q[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

static void deq_q6_k(const uint8_t *b, float *y) { /* ql[128], qh[64], int8 scales[16], d */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = fp16(b + 208);
    for (int n = 0; n < 2; n++, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same values, 16 lanes at a time: codes widened to int32, then one FMA each with
   the block's scale and offset (d * q - m is llama.cpp's d * (q - z) for Q4_0/Q5_0/Q8_0
   and Q6_K: exact in fp32 up to the FMA's single rounding). Each vector of 16 weights
   goes to a `Sink`: stored (y), or straight into FMAs with R rows of x (no buffer: the
   decode GEMV), into one of 4 accumulators a row picked by its offset in the block, so
   consecutive FMAs do not wait on each other. Everything is inlined into the callers
   below with R a constant, so the accumulators stay in registers. */
#define VECTOR_BLOCKS 1
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_FUSED 8 /* rows of x a fused pass takes: all below PANEL_ROWS */

typedef struct {
    float *y;         /* store here, or (NULL) ... */
    const float *x;   /* ... FMA with these rows of x (row stride ldx) */
    long ldx, R;
    __m512 (*acc)[4]; /* [R][4] */
} Sink;

ALWAYS_INLINE void emit(const Sink *s, long k, int off, __m512 w) {
    if (s->y) {
        _mm512_storeu_ps(s->y + k + off, w);
        return;
    }
    for (long r = 0; r < s->R; r++) {
        /* 4 chains a row for few rows; from 4 rows on the rows are the chains */
        __m512 *a = &s->acc[r][s->R < 4 ? (off >> 4) & 3 : 0];
        *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(s->x + r * s->ldx + k + off), *a);
    }
}

ALWAYS_INLINE __m512 u8_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

/* 4- and 5-bit codes take their value from a table of the block's 16 or 32 values
   (d * i - m, one FMA per table), one permute a vector in place of a convert and an FMA */
ALWAYS_INLINE __m512 iota_ps(float from) {
    return _mm512_add_ps(_mm512_set1_ps(from), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                               11, 12, 13, 14, 15));
}

ALWAYS_INLINE __m512i lo_nibbles(__m128i v) {
    return _mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(15)));
}

ALWAYS_INLINE __m512i hi_nibbles(__m128i v) {
    return _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)));
}

ALWAYS_INLINE void vdeq_q4_0(const uint8_t *b, const Sink *s, long k) {
    float d = fp16(b);
    __m512 table = _mm512_mul_ps(iota_ps(-8.f), _mm512_set1_ps(d)); /* (i - 8) d */
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2));
    emit(s, k, 0, _mm512_permutexvar_ps(lo_nibbles(qs), table));
    emit(s, k, 16, _mm512_permutexvar_ps(hi_nibbles(qs), table));
}

ALWAYS_INLINE void vdeq_q5_0(const uint8_t *b, const Sink *s, long k) {
    float d = fp16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    __m512 vd = _mm512_set1_ps(d); /* (i - 16) d for i < 16 and i >= 16 */
    __m512 t0 = _mm512_mul_ps(iota_ps(-16.f), vd), t1 = _mm512_mul_ps(iota_ps(0.f), vd);
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + 6));
    const __m512i sixteen = _mm512_set1_epi32(16); /* weight j's fifth bit: bit j of qh */
    __m512i lo = lo_nibbles(qs), hi = hi_nibbles(qs);
    lo = _mm512_mask_add_epi32(lo, (__mmask16)(qh & 0xffff), lo, sixteen);
    hi = _mm512_mask_add_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
    emit(s, k, 0, _mm512_permutex2var_ps(t0, lo, t1));
    emit(s, k, 16, _mm512_permutex2var_ps(t0, hi, t1));
}

ALWAYS_INLINE void vdeq_q8_0(const uint8_t *b, const Sink *s, long k) {
    __m512 d = _mm512_set1_ps(fp16(b));
    __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
    __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
    emit(s, k, 0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
    emit(s, k, 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
}

/* Q4_K/Q5_K: sub-blocks 2j (low nibbles) and 2j + 1 (high) of 32 weights each, at
   q + 32 j; `hb`, for Q5_K, the fifth bits (qh), NULL for Q4_K */
ALWAYS_INLINE void vdeq_k45(const uint8_t *b, const uint8_t *q, const uint8_t *hb,
                            const Sink *s, long k) {
    float d = fp16(b), dmin = fp16(b + 2), sc, m;
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (int j = 0; j < 4; j++, q += 32) {
        __m512 t[2][2]; /* sub-block 2j + i: d sc i - dmin m, i < 16 and i >= 16 (Q5_K) */
        for (int i = 0; i < 2; i++) {
            scale_min_k4(2 * j + i, b + 4, &sc, &m);
            __m512 vd = _mm512_set1_ps(d * sc), vm = _mm512_set1_ps(dmin * m);
            t[i][0] = _mm512_fmsub_ps(iota_ps(0.f), vd, vm);
            t[i][1] = hb ? _mm512_fmsub_ps(iota_ps(16.f), vd, vm) : t[i][0];
        }
        for (int h = 0; h < 2; h++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * h));
            __m512i lo = lo_nibbles(v), hi = hi_nibbles(v);
            if (hb) {
                __m128i bits = _mm_loadu_si128((const __m128i *)(hb + 16 * h));
                __mmask16 b1 = _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(1 << (2 * j))));
                __mmask16 b2 = _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(2 << (2 * j))));
                lo = _mm512_mask_add_epi32(lo, b1, lo, sixteen);
                hi = _mm512_mask_add_epi32(hi, b2, hi, sixteen);
                emit(s, k, 64 * j + 16 * h, _mm512_permutex2var_ps(t[0][0], lo, t[0][1]));
                emit(s, k, 64 * j + 32 + 16 * h, _mm512_permutex2var_ps(t[1][0], hi, t[1][1]));
            } else {
                emit(s, k, 64 * j + 16 * h, _mm512_permutexvar_ps(lo, t[0][0]));
                emit(s, k, 64 * j + 32 + 16 * h, _mm512_permutexvar_ps(hi, t[1][0]));
            }
        }
    }
}

ALWAYS_INLINE void vdeq_q4_k(const uint8_t *b, const Sink *s, long k) {
    vdeq_k45(b, b + 16, NULL, s, k);
}

ALWAYS_INLINE void vdeq_q5_k(const uint8_t *b, const Sink *s, long k) {
    vdeq_k45(b, b + 48, b + 16, s, k);
}

ALWAYS_INLINE void vdeq_q6_k(const uint8_t *b, const Sink *s, long k) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = fp16(b + 208);
    const __m128i nib = _mm_set1_epi8(15), three = _mm_set1_epi8(3);
    for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8) {
        for (int h = 0; h < 2; h++) { /* l = 16 h .. 16 h + 15 */
            __m128i a = _mm_loadu_si128((const __m128i *)(ql + 16 * h));
            __m128i c = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * h));
            __m128i e = _mm_loadu_si128((const __m128i *)(qh + 16 * h));
            __m128i q[4] = {/* 6-bit codes of y[l], y[l + 32], y[l + 64], y[l + 96] */
                _mm_or_si128(_mm_and_si128(a, nib), _mm_slli_epi16(_mm_and_si128(e, three), 4)),
                _mm_or_si128(_mm_and_si128(c, nib),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(e, 2), three), 4)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), nib),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(e, 4), three), 4)),
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), nib),
                             _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(e, 6), three), 4)),
            };
            for (int i = 0; i < 4; i++) {
                float ds = d * (float)sc[h + 2 * i];
                __m512 w = _mm512_fmsub_ps(u8_ps(q[i]), _mm512_set1_ps(ds),
                                           _mm512_set1_ps(32.f * ds));
                emit(s, k, 128 * n + 32 * i + 16 * h, w);
            }
        }
    }
}

/* a row's blocks through one of the vdeq_* above */
#define EACH_BLOCK(VDEQ, ELEMS, BYTES, SINK)                                                 \
    for (long i = 0; i < K / (ELEMS); i++) VDEQ(row + i * (BYTES), SINK, i * (ELEMS))

#define STORE_ROW(VDEQ, ELEMS, BYTES)                                                        \
    static void VDEQ##_row(const uint8_t *row, long K, float *y) {                           \
        Sink s = {y, NULL, 0, 0, NULL};                                                       \
        EACH_BLOCK(VDEQ, ELEMS, BYTES, &s);                                                   \
    }

/* out[r] = row . x[r] for R (<= MAX_FUSED) rows of x, the row dequantized in registers */
#define FUSED_ROW(VDEQ, ELEMS, BYTES)                                                        \
    ALWAYS_INLINE void VDEQ##_dot_r(const uint8_t *row, long K, const float *x, long ldx,     \
                                    float *out, const long R) {                               \
        __m512 acc[MAX_FUSED][4];                                                             \
        for (long r = 0; r < R; r++)                                                          \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                      \
        Sink s = {NULL, x, ldx, R, acc};                                                      \
        EACH_BLOCK(VDEQ, ELEMS, BYTES, &s);                                                   \
        for (long r = 0; r < R; r++)                                                          \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), \
                                                        _mm512_add_ps(acc[r][2], acc[r][3]))); \
    }                                                                                         \
    static void VDEQ##_dot(const uint8_t *row, long K, const float *x, long ldx, long R,      \
                           float *out) {                                                      \
        switch (R) {                                                                          \
        case 1: VDEQ##_dot_r(row, K, x, ldx, out, 1); break;                                  \
        case 2: VDEQ##_dot_r(row, K, x, ldx, out, 2); break;                                  \
        case 3: VDEQ##_dot_r(row, K, x, ldx, out, 3); break;                                  \
        case 4: VDEQ##_dot_r(row, K, x, ldx, out, 4); break;                                  \
        case 5: VDEQ##_dot_r(row, K, x, ldx, out, 5); break;                                  \
        case 6: VDEQ##_dot_r(row, K, x, ldx, out, 6); break;                                  \
        case 7: VDEQ##_dot_r(row, K, x, ldx, out, 7); break;                                  \
        default: VDEQ##_dot_r(row, K, x, ldx, out, 8); break;                                 \
        }                                                                                     \
    }

#define VECTOR_TYPE(VDEQ, ELEMS, BYTES) STORE_ROW(VDEQ, ELEMS, BYTES) FUSED_ROW(VDEQ, ELEMS, BYTES)
VECTOR_TYPE(vdeq_q4_0, 32, 18)
VECTOR_TYPE(vdeq_q5_0, 32, 22)
VECTOR_TYPE(vdeq_q8_0, 32, 34)
VECTOR_TYPE(vdeq_q4_k, 256, 144)
VECTOR_TYPE(vdeq_q5_k, 256, 176)
VECTOR_TYPE(vdeq_q6_k, 256, 210)

typedef void (*fused_dot)(const uint8_t *, long, const float *, long, long, float *);

/* the fused GEMV of a block type, NULL for the float types (they take the buffer) */
static fused_dot fused_of(long type) {
    switch (type) {
    case T_Q4_0: return vdeq_q4_0_dot;
    case T_Q5_0: return vdeq_q5_0_dot;
    case T_Q8_0: return vdeq_q8_0_dot;
    case T_Q4_K: return vdeq_q4_k_dot;
    case T_Q5_K: return vdeq_q5_k_dot;
    case T_Q6_K: return vdeq_q6_k_dot;
    }
    return NULL;
}
#endif

/* one row of K weights -> y [K] */
static void deq_row(long type, const uint8_t *row, long K, float *y) {
    switch (type) {
    case T_F32: memcpy(y, row, sizeof(float) * K); return;
    case T_F16:
        for (long k = 0; k < K; k++) y[k] = fp16(row + 2 * k);
        return;
    case T_BF16:
        for (long k = 0; k < K; k++) {
            union { uint32_t u; float f; } c = {.u = (uint32_t)(row[2 * k] | row[2 * k + 1] << 8)
                                                     << 16};
            y[k] = c.f;
        }
        return;
    }
#ifdef VECTOR_BLOCKS
    switch (type) {
    case T_Q4_0: vdeq_q4_0_row(row, K, y); return;
    case T_Q5_0: vdeq_q5_0_row(row, K, y); return;
    case T_Q8_0: vdeq_q8_0_row(row, K, y); return;
    case T_Q4_K: vdeq_q4_k_row(row, K, y); return;
    case T_Q5_K: vdeq_q5_k_row(row, K, y); return;
    case T_Q6_K: vdeq_q6_k_row(row, K, y); return;
    }
#endif
    void (*block)(const uint8_t *, float *) = NULL;
    switch (type) {
    case T_Q4_0: block = deq_q4_0; break;
    case T_Q5_0: block = deq_q5_0; break;
    case T_Q8_0: block = deq_q8_0; break;
    case T_Q4_K: block = deq_q4_k; break;
    case T_Q5_K: block = deq_q5_k; break;
    case T_Q6_K: block = deq_q6_k; break;
    }
    long elems, bytes;
    block_shape(type, &elems, &bytes);
    for (long i = 0; i < K / elems; i++) block(row + i * bytes, y + i * elems);
}

void bs_ggml_dequantize(long type, const void *data, long rows, long K, float *out) {
    long rb = bs_ggml_row_bytes(type, K);
    for (long r = 0; r < rows; r++) deq_row(type, (const uint8_t *)data + r * rb, K, out + r * K);
}


/* -- int8 activations ("a8", the default) ------------------------------------------------
   llama.cpp's own CPU scheme: x is quantized to int8 in blocks of 32 columns (absmax / 127
   each, as its q8_0) and meets the weights' integer codes in AVX512-VNNI dot products, 64
   multiply-adds an instruction, where fp32 FMAs do 16. The codes are the file's own,
   repacked once at load (bs_ggml_a8_pack) as the int4 kernel's tiles (qgemm.c): 16
   output rows a tile, each 32-bit lane one output row, so a broadcast of 4 (8-bit codes)
   or 8 (4-bit) activations meets all 16 rows. Per group of 16 or 32 columns a weight is
   scale * code + offset (scale d * sc and offset -dmin * m for Q4_K, -32 d sc for Q6_K,
   -8 d for Q4_0, ...), so y = sum over groups of scale * dx * (code . x^) + offset *
   sum(x^ of the group): exactly W . x^ for the quantized x^, W as llama.cpp dequantizes
   it up to fp32 rounding. Its cost is x's rounding (bench.perplexity measures it), as in
   llama.cpp (which rounds x per 256 for the K-quants, its q8_K; here per 32 for all).

   The microkernel (a8_micro) takes up to A8_ROWS rows of x against two tiles (32 output
   rows, a pool task): each code vector is loaded once for all rows, each 4 bytes of x
   are a broadcast operand of the instruction for both tiles. What it cannot shed is the
   per-group float work, one convert and two multiply-adds a row, tile and group against
   8 VNNI instructions (4 for Q6_K's groups of 16), on the same two vector pipes of this
   class of core (AMD Zen 4: `python -m bench.gguf --kernels` prints the fraction of the
   VNNI peak each reaches); the constant offsets (Q4_0, Q5_0, Q8_0, Q6_K) start the
   integer dot at - c * sum(x^) instead of a third multiply-add. */

/* one block -> its codes u [elems] and each group's scale s and offset z */
static void a8_block(long type, const uint8_t *b, uint8_t *u, float *s, float *z) {
    float sc, m;
    switch (type) {
    case T_Q4_0: {
        float d = fp16(b);
        for (int j = 0; j < 16; j++) u[j] = b[2 + j] & 15, u[j + 16] = b[2 + j] >> 4;
        s[0] = d, z[0] = -8.f * d;
        return;
    }
    case T_Q5_0: {
        float d = fp16(b);
        uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                      (uint32_t)b[5] << 24;
        for (int j = 0; j < 16; j++) {
            u[j] = (uint8_t)((b[6 + j] & 15) | (((qh >> j) << 4) & 0x10));
            u[j + 16] = (uint8_t)((b[6 + j] >> 4) | ((qh >> (j + 12)) & 0x10));
        }
        s[0] = d, z[0] = -16.f * d;
        return;
    }
    case T_Q8_0: {
        float d = fp16(b);
        for (int j = 0; j < 32; j++) u[j] = (uint8_t)((int)(int8_t)b[2 + j] + 128);
        s[0] = d, z[0] = -128.f * d;
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        float d = fp16(b), dmin = fp16(b + 2);
        const uint8_t *qh = b + 16, *q = b + (type == T_Q5_K ? 48 : 16);
        for (int j = 0; j < 4; j++, q += 32) {
            for (int i = 0; i < 2; i++) {
                scale_min_k4(2 * j + i, b + 4, &sc, &m);
                s[2 * j + i] = d * sc, z[2 * j + i] = -(dmin * m);
            }
            for (int l = 0; l < 32; l++) {
                int h1 = type == T_Q5_K && (qh[l] & (1 << (2 * j))) ? 16 : 0;
                int h2 = type == T_Q5_K && (qh[l] & (2 << (2 * j))) ? 16 : 0;
                u[64 * j + l] = (uint8_t)((q[l] & 15) + h1);
                u[64 * j + 32 + l] = (uint8_t)((q[l] >> 4) + h2);
            }
        }
        return;
    }
    case T_Q6_K: { /* group g of 16 (y[16 g ..]) has scale sc[g] */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scl = (const int8_t *)(b + 192);
        float d = fp16(b + 208);
        for (int g = 0; g < 16; g++) s[g] = d * (float)scl[g], z[g] = -32.f * s[g];
        for (int n = 0; n < 2; n++, u += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                u[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                u[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                u[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                u[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        return;
    }
    }
}

/* (group, bits) of a type's a8 layout; 0 bits: not one it takes */
static void a8_shape(long type, long *group, long *bits) {
    *group = type == T_Q6_K ? 16 : 32;
    *bits = (type == T_Q4_0 || type == T_Q4_K) ? 4 : 8;
    if (type != T_Q4_0 && type != T_Q5_0 && type != T_Q8_0 && type != T_Q4_K &&
        type != T_Q5_K && type != T_Q6_K)
        *bits = 0;
}

/* byte offset of row n, column k's code in the tiles (4 bits: low nibble for k % 8 < 4) */
static inline long a8_at(long K, long bits, long n, long k) {
    if (bits == 4) return ((n / 16 * (K / 8) + k / 8) * 16 + n % 16) * 4 + k % 4;
    return ((n / 16 * (K / 4) + k / 4) * 16 + n % 16) * 4 + k % 4;
}

long bs_ggml_a8_pack(long type, const void *data, long rows, long K, uint8_t *tiles, float *sz,
                     long *group, long *bits) {
    long elems, bytes, rb = bs_ggml_row_bytes(type, K);
    a8_shape(type, group, bits);
    block_shape(type, &elems, &bytes);
    if (*bits == 0 || rb < 0) return -1;
    long rows16 = (rows + 15) / 16 * 16, G = *group, ng = K / G, total = rows16 * K * *bits / 8;
    if (tiles == NULL || sz == NULL) return total;
    memset(tiles, 0, (size_t)total);
    memset(sz, 0, sizeof(float) * (size_t)(rows16 / 16 * ng * 32));
    uint8_t u[256];
    float s[16], z[16];
    for (long n = 0; n < rows; n++)
        for (long i = 0; i < K / elems; i++) {
            a8_block(type, (const uint8_t *)data + n * rb + i * bytes, u, s, z);
            for (long e = 0; e < elems; e++) {
                long k = i * elems + e, at = a8_at(K, *bits, n, k);
                tiles[at] |= *bits == 4 && k % 8 >= 4 ? (uint8_t)(u[e] << 4) : u[e];
            }
            for (long j = 0; j < elems / G; j++) {
                long g = i * elems / G + j, at = ((n / 16 * ng + g) * 2) * 16 + n % 16;
                sz[at] = s[j], sz[at + 16] = z[j];
            }
        }
    return total;
}

typedef struct {
    int8_t *xq; /* [M][K] */
    float *dx;  /* [M][K / 32]: each block's scale */
    float *xs;  /* [M][K / 32]: dx * the block's sum of xq */
    int32_t *is; /* [M][K / 16]: the sum of xq over each 16 columns */
} A8X;

static void a8_quantize(const float *x, long ldx, long M, long K, A8X *a) {
    a->xq = (int8_t *)malloc((size_t)(M * K));
    a->dx = (float *)malloc(sizeof(float) * (size_t)(M * K / 32));
    a->xs = (float *)malloc(sizeof(float) * (size_t)(M * K / 32));
    a->is = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * K / 16));
    for (long m = 0; m < M; m++)
        for (long b = 0; b < K / 32; b++) {
            const float *xb = x + m * ldx + 32 * b;
            float amax = 0.f;
            for (int k = 0; k < 32; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
            float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *q = a->xq + m * K + 32 * b;
            int total = 0;
            for (int h = 0; h < 2; h++) {
                int sum = 0;
                for (int k = 16 * h; k < 16 * h + 16; k++) {
                    int v = (int)nearbyintf(xb[k] * inv);
                    q[k] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
                    sum += q[k];
                }
                a->is[m * (K / 16) + 2 * b + h] = sum;
                total += sum;
            }
            a->dx[m * (K / 32) + b] = d;
            a->xs[m * (K / 32) + b] = d * (float)total;
        }
}

static void a8_free(A8X *a) {
    free(a->xq), free(a->dx), free(a->xs), free(a->is);
}

/* the offset c of a type whose weights are s * (code - c), 0 for Q4_K/Q5_K (their own
   offset per group): the offset then folds into the integer dot product as - c * sum(x^) */
static inline int a8_offset(long type) {
    switch (type) {
    case T_Q4_0: return 8;
    case T_Q5_0: return 16;
    case T_Q8_0: return 128;
    case T_Q6_K: return 32;
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_VNNI 1
#define A8_ROWS 6 /* rows of x a microkernel pass takes (at least 2) */
/* acc += codes (u8) . the 4 int8 at x broadcast to every lane: the broadcast an operand
   of the instruction ({1to16}), so the codes stay in a register across rows and tiles
   (left to itself the compiler reloads them for every row: a 64-byte load each) */
static inline __attribute__((always_inline)) __m512i dp_bcast(__m512i acc, __m512i codes,
                                                              const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const int32_t *)x));
    return acc;
}
/* The microkernel: rows m0 .. m0 + R - 1 of x^ against tiles t0 .. t0 + T - 1 of part p
   -> out [R][T * 16]. R x T int32 dot products per group (each code vector loaded once
   for R rows, each broadcast of x^ used for T tiles), then per group one convert and two
   multiply-adds a row and tile: the scale s * dx, and for Q4_K/Q5_K the offset times
   the block's sum of x^ (the other types start their dot at - c * sum(x^) instead).
   BITS, G, R, T and Z are constants after inlining, so everything stays in registers. */
static inline __attribute__((always_inline)) void a8_micro(const GgmlPart *p, long K,
                                                           const A8X *a, long m0, long t0,
                                                           float *out, const long R,
                                                           const long T, const int BITS,
                                                           const int G, const int Z) {
    const long tile_bytes = K * BITS * 2, tile_sz = (K / G) * 32;
    const uint8_t *codes = p->tiles + t0 * tile_bytes;
    const float *sz = p->sz + t0 * tile_sz;
    const int8_t *xq = a->xq + m0 * K;
    const float *dx = a->dx + m0 * (K / 32), *xs = a->xs + m0 * (K / 32);
    const int32_t *is = a->is + m0 * (K / 16);
    const int c = a8_offset(p->type);
    const __m512i nib = _mm512_set1_epi8(15);
    __m512 acc[A8_ROWS][2];
    for (long r = 0; r < R; r++)
        for (long t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (long g = 0; g < K / G; g++) {
        __m512i dot[A8_ROWS][2];
        for (long r = 0; r < R; r++) {
            int sum = G == 16 ? is[r * (K / 16) + g]
                              : is[r * (K / 16) + 2 * g] + is[r * (K / 16) + 2 * g + 1];
            __m512i init = Z ? _mm512_setzero_si512() : _mm512_set1_epi32(-c * sum);
            for (long t = 0; t < T; t++) dot[r][t] = init;
        }
        /* one row: odd steps into a second chain (rows slot 1), so 2 T chains hide the
           instruction's latency */
        const long S = R == 1 ? 2 : 1;
        if (S == 2)
            for (long t = 0; t < T; t++) dot[1][t] = _mm512_setzero_si512();
        if (BITS == 4) {
            for (long j = 0; j < G / 8; j++) {
                __m512i lo[2], hi[2];
                for (long t = 0; t < T; t++) {
                    __m512i v = _mm512_loadu_si512(codes + t * tile_bytes + (g * (G / 8) + j) * 64);
                    lo[t] = _mm512_and_si512(v, nib);
                    hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                }
                for (long r = 0; r < R; r++) {
                    const int8_t *xk = xq + r * K + g * G + 8 * j;
                    long c = S == 2 ? (j & 1) : r;
                    for (long t = 0; t < T; t++) {
                        dot[c][t] = dp_bcast(dot[c][t], lo[t], xk);
                        dot[c][t] = dp_bcast(dot[c][t], hi[t], xk + 4);
                    }
                }
            }
        } else {
            for (long j = 0; j < G / 4; j++) {
                __m512i v[2];
                for (long t = 0; t < T; t++)
                    v[t] = _mm512_loadu_si512(codes + t * tile_bytes + (g * (G / 4) + j) * 64);
                for (long r = 0; r < R; r++)
                    for (long t = 0; t < T; t++) {
                        long c = S == 2 ? (j & 1) : r;
                        dot[c][t] = dp_bcast(dot[c][t], v[t], xq + r * K + g * G + 4 * j);
                    }
            }
        }
        if (S == 2)
            for (long t = 0; t < T; t++) dot[0][t] = _mm512_add_epi32(dot[0][t], dot[1][t]);
        __m512 s[2], z[2];
        for (long t = 0; t < T; t++) {
            s[t] = _mm512_loadu_ps(sz + t * tile_sz + g * 32);
            if (Z) z[t] = _mm512_loadu_ps(sz + t * tile_sz + g * 32 + 16);
        }
        for (long r = 0; r < R; r++) {
            __m512 d = _mm512_set1_ps(dx[r * (K / 32) + g * G / 32]);
            for (long t = 0; t < T; t++) {
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), _mm512_mul_ps(s[t], d),
                                            acc[r][t]);
                if (Z) acc[r][t] = _mm512_fmadd_ps(z[t], _mm512_set1_ps(xs[r * (K / 32) + g]),
                                                   acc[r][t]);
            }
        }
    }
    for (long r = 0; r < R; r++)
        for (long t = 0; t < T; t++) _mm512_storeu_ps(out + (r * T + t) * 16, acc[r][t]);
}

#define A8_RT(BITS, G, Z)                                                                    \
    switch (R * 2 + T - 1) {                                                                 \
    case 2: a8_micro(p, K, a, m0, t0, out, 1, 1, BITS, G, Z); break;                         \
    case 3: a8_micro(p, K, a, m0, t0, out, 1, 2, BITS, G, Z); break;                         \
    case 4: a8_micro(p, K, a, m0, t0, out, 2, 1, BITS, G, Z); break;                         \
    case 5: a8_micro(p, K, a, m0, t0, out, 2, 2, BITS, G, Z); break;                         \
    case 6: a8_micro(p, K, a, m0, t0, out, 3, 1, BITS, G, Z); break;                         \
    case 7: a8_micro(p, K, a, m0, t0, out, 3, 2, BITS, G, Z); break;                         \
    case 8: a8_micro(p, K, a, m0, t0, out, 4, 1, BITS, G, Z); break;                         \
    case 9: a8_micro(p, K, a, m0, t0, out, 4, 2, BITS, G, Z); break;                         \
    case 10: a8_micro(p, K, a, m0, t0, out, 5, 1, BITS, G, Z); break;                        \
    case 11: a8_micro(p, K, a, m0, t0, out, 5, 2, BITS, G, Z); break;                        \
    case 12: a8_micro(p, K, a, m0, t0, out, 6, 1, BITS, G, Z); break;                        \
    default: a8_micro(p, K, a, m0, t0, out, 6, 2, BITS, G, Z); break;                        \
    }
#else
#define A8_ROWS 6
#endif

/* rows m0 .. m0 + R - 1 (R <= A8_ROWS) against tiles t0 .. t0 + T - 1 (T <= 2) -> out
   [R][T * 16] */
static void a8_tiles(const GgmlPart *p, long K, const A8X *a, long m0, long t0, float *out,
                     long R, long T) {
#ifdef A8_VNNI
    int z = a8_offset(p->type) == 0;
    if (p->bits == 4) {
        if (z) {
            A8_RT(4, 32, 1)
        } else {
            A8_RT(4, 32, 0)
        }
    } else if (p->group == 16) {
        A8_RT(8, 16, 0)
    } else if (z) {
        A8_RT(8, 32, 1)
    } else {
        A8_RT(8, 32, 0)
    }
#else /* the same sums, one at a time */
    long G = p->group, ng = K / G;
    for (long r = 0; r < R; r++)
        for (long l = 0; l < 16 * T; l++) {
            float acc = 0.f;
            long t = t0 + l / 16, n = 16 * t + l % 16;
            for (long g = 0; g < ng; g++) {
                int32_t dot = 0;
                const int8_t *xg = a->xq + (m0 + r) * K + g * G;
                for (long k = g * G; k < g * G + G; k++) {
                    uint8_t byte = p->tiles[a8_at(K, p->bits, n, k)];
                    int code = p->bits == 8 ? byte : (k % 8 < 4 ? byte & 15 : byte >> 4);
                    dot += code * xg[k - g * G];
                }
                long at = ((t * ng + g) * 2) * 16 + l % 16;
                const int32_t *is = a->is + (m0 + r) * (K / 16);
                int sum = G == 16 ? is[g] : is[2 * g] + is[2 * g + 1];
                float d = a->dx[(m0 + r) * (K / 32) + g * G / 32];
                acc += (float)dot * (p->sz[at] * d);
                acc += p->sz[at + 16] * (d * (float)sum);
            }
            out[16 * T * r + l] = acc;
        }
#endif
}

/* W [rows, K] fp32 from a part's tiles: scale * code + offset, llama.cpp's values up to
   fp32 rounding (the layer's weights when the file's bytes were dropped after packing) */
void bs_ggml_a8_dequantize(const uint8_t *tiles, const float *sz, long rows, long K, long group,
                           long bits, float *out) {
    long ng = K / group;
    for (long n = 0; n < rows; n++)
        for (long k = 0; k < K; k++) {
            uint8_t byte = tiles[a8_at(K, bits, n, k)];
            int code = bits == 8 ? byte : (k % 8 < 4 ? byte & 15 : byte >> 4);
            long at = ((n / 16 * ng + k / group) * 2) * 16 + n % 16;
            out[n * K + k] = sz[at] * (float)code + sz[at + 16];
        }
}

/* -- y = x @ W.T ------------------------------------------------------------------------ */
static __thread float *scratch_buf;
static __thread long scratch_len;

static float *scratch(long n) { /* this thread's scratch of at least n floats */
    if (scratch_len < n) {
        free(scratch_buf);
        scratch_buf = (float *)aligned_alloc(64, (size_t)((n + 15) / 16 * 16) * sizeof(float));
        scratch_len = scratch_buf ? n : 0;
    }
    return scratch_buf;
}

typedef struct {
    const Weight *w;
    const float *x;
    long ldx, M;
    float *y;
    const A8X *a; /* x quantized, when a part has a8 tiles */
} Job;

#ifdef __AVX512F__
/* out [16][16] = the 16 x 16 block at in (row stride ld), transposed in registers */
static inline void transpose16(const float *in, long ld, float *out) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(in + i * ld);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        _mm512_storeu_ps(out + 16 * i, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
        _mm512_storeu_ps(out + 16 * (i + 8), _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
}
#endif

/* bs_pack's panels of rows [N, K] (N a multiple of 16), 16 x 16 blocks at a time */
static void pack_panels(const float *rows, long N, long K, float *P) {
#ifdef __AVX512F__
    if (K % 16 == 0) {
        for (long p = 0; p < N / 16; p++)
            for (long k = 0; k < K; k += 16)
                transpose16(rows + p * 16 * K + k, K, P + (p * K + k) * 16);
        return;
    }
#endif
    bs_pack(rows, N, K, P);
}

/* rows n0 .. n1 - 1 of part `p` (whose first output column is col) */
static void part_rows(const Job *J, const GgmlPart *p, long col, long n0, long n1) {
    long K = J->w->K, N = J->w->N, M = J->M, rb = bs_ggml_row_bytes(p->type, K);
    const uint8_t *data = (const uint8_t *)p->data;
    if (p->tiles) { /* int8 activations: whole tiles of 16 rows, two at a time (CHUNK 32) */
        float out[A8_ROWS * 32];
        long pair = M > 1 ? 2 : 1; /* one row: a tile at a time (measured faster) */
        for (long t0 = n0 / 16; t0 * 16 < n1; t0 += pair) {
            long T = n1 - 16 * t0 > 16 ? pair : 1;
            for (long m0 = 0; m0 < M; m0 += A8_ROWS) {
                long R = M - m0 < A8_ROWS ? M - m0 : A8_ROWS;
                a8_tiles(p, K, J->a, m0, t0, out, R, T);
                for (long r = 0; r < R; r++)
                    for (long t = 0; t < T; t++) {
                        long n = 16 * (t0 + t), nn = n1 - n < 16 ? n1 - n : 16;
                        memcpy(J->y + (m0 + r) * N + col + n, out + (r * T + t) * 16,
                               sizeof(float) * nn);
                    }
            }
        }
        return;
    }
    if (M < PANEL_ROWS) {
#ifdef VECTOR_BLOCKS
        fused_dot fused = fused_of(p->type);
        if (fused) { /* dequantized in registers, no buffer */
            float out[MAX_FUSED];
            for (long n = n0; n < n1; n++) {
                fused(data + n * rb, K, J->x, J->ldx, M, out);
                for (long m = 0; m < M; m++) J->y[m * N + col + n] = out[m];
            }
            return;
        }
#endif
        float *row = scratch(K);
        for (long n = n0; n < n1; n++) {
            deq_row(p->type, data + n * rb, K, row);
            for (long m = 0; m < M; m++) J->y[m * N + col + n] = dot(row, J->x + m * J->ldx, K);
        }
        return;
    }
    long R = n1 - n0, Rp = (R + 15) / 16 * 16;
    float *rows = scratch(2 * Rp * K + M * Rp), *panels = rows + Rp * K, *out = panels + Rp * K;
    for (long n = n0; n < n1; n++) deq_row(p->type, data + n * rb, K, rows + (n - n0) * K);
    memset(rows + R * K, 0, sizeof(float) * (Rp - R) * K);
    pack_panels(rows, Rp, K, panels);
    bs_linear_packed(J->x, J->ldx, M, K, panels, Rp, NULL, out);
    for (long m = 0; m < M; m++) memcpy(J->y + m * N + col + n0, out + m * Rp, sizeof(float) * R);
}

static void ggml_task(void *ctx, long t) {
    const Job *J = ctx;
    const GgmlPart *parts = (const GgmlPart *)J->w->parts;
    long col = 0;
    for (long i = 0; i < J->w->nparts; i++) {
        long chunks = (parts[i].rows + CHUNK - 1) / CHUNK;
        if (t < chunks) {
            long n0 = t * CHUNK, n1 = n0 + CHUNK < parts[i].rows ? n0 + CHUNK : parts[i].rows;
            part_rows(J, &parts[i], col, n0, n1);
            return;
        }
        t -= chunks, col += parts[i].rows;
    }
}

void bs_ggml_gemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    const GgmlPart *parts = (const GgmlPart *)w->parts;
    long tasks = 0;
    int a8 = 0;
    for (long i = 0; i < w->nparts; i++) {
        tasks += (parts[i].rows + CHUNK - 1) / CHUNK;
        a8 |= parts[i].tiles != NULL;
    }
    A8X a = {NULL, NULL, NULL, NULL};
    if (a8) a8_quantize(x, ldx, M, w->K, &a);
    Job job = {w, x, ldx, M, y, &a};
    bs_parallel(ggml_task, &job, tasks);
    a8_free(&a);
    if (w->bias)
        for (long m = 0; m < M; m++)
            for (long n = 0; n < w->N; n++) y[m * w->N + n] += w->bias[n];
}

#define PEAK_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
long bs_isa_peak(long kind, long iters) {
    long sink = 0;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (kind == 0) {
        __m512i b = _mm512_set1_epi8((char)(iters & 1)), c = _mm512_set1_epi8(2);
#define PI(i) __m512i a##i = _mm512_set1_epi32(i);
#define PS(i) a##i = _mm512_dpbusd_epi32(a##i, b, c);
#define PR(i) sink += _mm512_reduce_add_epi32(a##i);
        PEAK_CHAINS(PI)
        for (long n = 0; n < iters; n++) { PEAK_CHAINS(PS) }
        PEAK_CHAINS(PR)
        return sink & 1;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (kind == 1) {
        __m512bh b = (__m512bh)_mm512_set1_epi16((short)0x3f80);
#define FI(i) __m512 f##i = _mm512_set1_ps((float)i);
#define FS(i) f##i = _mm512_dpbf16_ps(f##i, b, b);
#define FR(i) sink += (long)_mm512_reduce_add_ps(f##i);
        PEAK_CHAINS(FI)
        for (long n = 0; n < iters; n++) { PEAK_CHAINS(FS) }
        PEAK_CHAINS(FR)
        return sink & 1;
    }
#endif
#ifdef __AVX512F__
    if (kind == 2) {
        __m512 x = _mm512_set1_ps(1e-9f * (float)(iters & 1));
#define GI(i) __m512 e##i = _mm512_set1_ps((float)i);
#define GS(i) e##i = _mm512_fmadd_ps(e##i, x, x);
#define GR(i) sink += (long)_mm512_reduce_add_ps(e##i);
        PEAK_CHAINS(GI)
        for (long n = 0; n < iters; n++) { PEAK_CHAINS(GS) }
        PEAK_CHAINS(GR)
        return sink & 1;
    }
#endif
    (void)iters;
    return kind >= 0 ? -1 : sink;
}
