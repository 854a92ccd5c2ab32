/* int8 and int4 GEMVs for quantized decode (kind 1 and 2 of `Weight`).

   Batch-1 decode reads every weight once per token, so it runs at the speed weights
   stream from memory: int8 reads a quarter of fp32's bytes, int4 an eighth.
   - int8 (a scale per output row): each weight row is widened to fp32 in registers once
     per tile of up to 4 rows of x; activations stay fp32. From `a8_rows` rows, a layer
     with int8 activations quantizes x per row (as its torch._int_mm path does) and runs
     AVX512-VNNI: 64 multiply-adds an instruction.
   - int4 (groups of 32/64/128, bf16 scale and zero), any number of rows: x is quantized
     to int8 in blocks of 32 (llama.cpp's q4_0 x q8_0 scheme) and meets the codes in VNNI
     dot products over weights repacked in tiles of 16 output rows (`Int4Linear.tiled`),
     so each lane of a vector is one output row and nothing needs a horizontal sum.
   Measured by `python -m bench.quant`. */
#include "internal.h"

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

#ifdef __AVX512F__
/* rows r < R of x (row stride ldx) against weight row n; R is a constant after inlining,
   so the 4 x R accumulators stay in registers and each weight vector is widened once. */
static inline __attribute__((always_inline)) void q8_tile(const Weight *w, const float *x,
                                                          long ldx, long n, float *out,
                                                          const long R) {
    const int8_t *wn = (const int8_t *)w->data + n * w->K;
    long K = w->K, k = 0;
    __m512 acc[4][4];
    for (long r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (; k + 64 <= K; k += 64) {
        __m512 wv[4];
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wn + k + 16 * j))));
        for (long r = 0; r < R; r++)
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(x + r * ldx + k + 16 * j),
                                            acc[r][j]);
    }
    for (; k + 16 <= K; k += 16) {
        __m512 wv =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wn + k))));
        for (long r = 0; r < R; r++)
            acc[r][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * ldx + k), acc[r][0]);
    }
    for (long r = 0; r < R; r++) {
        __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                 _mm512_add_ps(acc[r][2], acc[r][3]));
        float t = _mm512_reduce_add_ps(s);
        for (long kk = k; kk < K; kk++) t += (float)wn[kk] * x[r * ldx + kk];
        out[r] = t;
    }
}
#endif

static void q8_row_plain(const Weight *w, const float *x, long n, float *out) {
    const int8_t *wn = (const int8_t *)w->data + n * w->K;
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (long k = 0; k < w->K; k++) t += (float)wn[k] * x[k];
    *out = t;
}

/* int4, tiled (Int4Linear.tiled), against int8 activations the way llama.cpp's q4_0 x q8_0
   dot works: x is quantized in blocks of 32 columns (absmax / 127 each) and meets the
   codes, as unsigned bytes, in AVX512-VNNI dot products (64 multiply-adds an instruction).
   A tile is 16 output rows: per 8 columns k .. k + 7, 64 bytes, 4 a row, byte j holding
   column k + j in its low nibble and k + 4 + j in its high one. So one 64-byte load is
   128 weights, each 32-bit lane is one output row, and a broadcast of 4 activations
   meets all 16 rows: no horizontal sums, and the scales of a group are one 16-wide load
   (bf16 [tile][group][scale, zero][16]). Each block of 32 columns is scaled in fp32 once
   (weight scale x activation scale); the zero points act once per group through the
   group's sum of quantized x. The result is exactly W . x^ for the quantized x^. */
typedef struct {
    int8_t *xq;  /* [M][Kp] */
    float *dx;   /* [M][Kp / 32]: the scale of each block of 32 columns */
    float *xsum; /* [M][G]: sum of x^ over each weight group */
} Q4X;

static void q4x_prepare(const Weight *w, const float *x, long ldx, long M, Q4X *px) {
    long K = w->K, Kp = w->Kp, g = w->group, G = Kp / g, nb = Kp / 32;
    px->xq = (int8_t *)calloc(M * Kp, 1);
    px->dx = (float *)calloc(M * nb, sizeof(float));
    px->xsum = (float *)calloc(M * G, sizeof(float));
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        for (long b = 0; b < nb; b++) {
            long k0 = 32 * b, k1 = k0 + 32 < K ? k0 + 32 : K;
            float amax = 0.f;
            float xv[32]; /* act-order: the gather of x rides on its quantization */
            for (long k = k0; k < k1; k++) xv[k - k0] = xm[w->perm ? w->perm[k] : k];
            for (long k = k0; k < k1; k++) amax = fabsf(xv[k - k0]) > amax ? fabsf(xv[k - k0]) : amax;
            float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            long sum = 0;
            for (long k = k0; k < k1; k++) {
                int v = (int)nearbyintf(xv[k - k0] * inv);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                px->xq[m * Kp + k] = (int8_t)v;
                sum += v;
            }
            px->dx[m * nb + b] = d;
            px->xsum[m * G + k0 / g] += d * (float)sum;
        }
    }
}

static inline float q4t_weight(const Weight *w, long n, long k) {
    long Kp = w->Kp, G = Kp / w->group, t = n / 16, l = n % 16;
    uint8_t byte = ((const uint8_t *)w->data)[((t * (Kp / 8) + k / 8) * 16 + l) * 4 + k % 4];
    int q = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
    long at = (t * G + k / w->group) * 32 + l;
    if (w->scale) return (float)(q - 8) * w->scale[at] + w->scale[at + 16];
    return (float)(q - 8) * bf16_to_float(w->s4[at]) + bf16_to_float(w->s4[at + 16]);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512 bf16x16_ps(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* 16 scales (half 0) or zeros (half 1) of tile t, group gi: fp32 when `scale` holds them
   (a checkpoint's fp16 carried exactly: 64 bytes a load instead of 32, ~6% more bytes
   than the codes' at group 128), else bf16 */
static inline __m512 q4t_sz(const Weight *w, long t, long gi, long half) {
    long at = ((t * (w->Kp / w->group) + gi) * 2 + half) * 16;
    return w->scale ? _mm512_loadu_ps(w->scale + at) : bf16x16_ps(w->s4 + at);
}

/* rows r < R of x (quantized) against output rows 16 t .. 16 t + 15 -> out [R][16] */
static inline __attribute__((always_inline)) void q4t_tile(const Weight *w, const Q4X *px,
                                                           long m0, long t, float *out,
                                                           const long R) {
    long Kp = w->Kp, g = w->group, G = Kp / g, nb = Kp / 32;
    const uint8_t *codes = (const uint8_t *)w->data + t * (Kp / 8) * 64;
    const int8_t *xq = px->xq + m0 * Kp;
    const float *dx = px->dx + m0 * nb, *xsum = px->xsum + m0 * G;
    const __m512i nib = _mm512_set1_epi8(15);
    __m512 acc[8];
    for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        __m512i dot[8];
        for (long r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        for (long j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512(codes + (4 * b + j) * 64);
            __m512i lo = _mm512_and_si512(v, nib);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            for (long r = 0; r < R; r++) {
                const int8_t *xk = xq + r * Kp + 32 * b + 8 * j;
                int32_t x0, x1;
                memcpy(&x0, xk, 4);
                memcpy(&x1, xk + 4, 4);
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(x0));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(x1));
            }
        }
        __m512 s = q4t_sz(w, t, 32 * b / g, 0);
        for (long r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                     _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
    for (long gi = 0; gi < G; gi++) { /* zero points: (z - 8 s) * sum(x^ of the group) */
        __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), q4t_sz(w, t, gi, 0), q4t_sz(w, t, gi, 1));
        for (long r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum[r * G + gi]), acc[r]);
    }
    for (long r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#endif

#define Q4T_ROWS 8  /* rows of x a tile */
#define Q4T_CHUNK 64 /* rows of x that meet all the weights before the next rows do */

#define Q4T_TILES 4 /* tiles (of 16 output rows) a pool task */

typedef struct {
    const Weight *w;
    const Q4X *px;
    long M;
    float *y;
    long tasks_n; /* tasks a chunk of Q4T_CHUNK rows of x */
} Q4Job;

/* task t: tiles [Q4T_TILES * (t % tasks_n), + Q4T_TILES) for rows of x in chunk t / tasks_n */
static void q4t_task(void *ctx, long task) {
    const Q4Job *J = ctx;
    const Weight *w = J->w;
    const Q4X *px = J->px;
    long M = J->M, N = w->N, tiles = (N + 15) / 16;
    float *y = J->y;
    float out[Q4T_ROWS * 16];
    long c0 = task / J->tasks_n * Q4T_CHUNK, c1 = c0 + Q4T_CHUNK < M ? c0 + Q4T_CHUNK : M;
    long t0 = task % J->tasks_n * Q4T_TILES, t1 = t0 + Q4T_TILES < tiles ? t0 + Q4T_TILES : tiles;
    for (long t = t0; t < t1; t++) {
        long n0 = 16 * t, nn = N - n0 < 16 ? N - n0 : 16;
        for (long m0 = c0; m0 < c1; m0 += Q4T_ROWS) {
            long R = c1 - m0 < Q4T_ROWS ? c1 - m0 : Q4T_ROWS;
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
            switch (R) {
            case 1: q4t_tile(w, px, m0, t, out, 1); break;
            case 2: q4t_tile(w, px, m0, t, out, 2); break;
            case 3: q4t_tile(w, px, m0, t, out, 3); break;
            case 4: q4t_tile(w, px, m0, t, out, 4); break;
            case 5: q4t_tile(w, px, m0, t, out, 5); break;
            case 6: q4t_tile(w, px, m0, t, out, 6); break;
            case 7: q4t_tile(w, px, m0, t, out, 7); break;
            default: q4t_tile(w, px, m0, t, out, 8); break;
            }
#else
            for (long r = 0; r < R; r++)
                for (long l = 0; l < nn; l++) {
                    float acc = 0.f;
                    for (long k = 0; k < w->K; k++)
                        acc += q4t_weight(w, n0 + l, k) *
                               (float)px->xq[(m0 + r) * w->Kp + k] *
                               px->dx[(m0 + r) * (w->Kp / 32) + k / 32];
                    out[16 * r + l] = acc;
                }
#endif
            for (long r = 0; r < R; r++)
                for (long l = 0; l < nn; l++)
                    y[(m0 + r) * N + n0 + l] =
                        out[16 * r + l] + (w->bias ? w->bias[n0 + l] : 0.f);
        }
    }
}

/* x quantized once (q4x_prepare), then tiles x chunks of rows over the pool: each output
   is computed alike whichever thread takes it */
static void q4t_gemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    long tiles = (w->N + 15) / 16;
    Q4X px;
    q4x_prepare(w, x, ldx, M, &px);
    Q4Job job = {w, &px, M, y, (tiles + Q4T_TILES - 1) / Q4T_TILES};
    bs_parallel(q4t_task, &job, (M + Q4T_CHUNK - 1) / Q4T_CHUNK * job.tasks_n);
    free(px.xq);
    free(px.dx);
    free(px.xsum);
}

/* -- int8 weights x int8 activations (kind 1 with `wsum`): an exact int32 GEMM ----------
   W is the layer's own qweight [N, K] (s8, row-major: the one copy, what _int_mm read
   too), x is rounded per row as Int8Linear.quantize_activations does (absmax / 127) and
   stored as u8 (x + 128, rows padded to 64 columns), so one vpdpbusd is 64 multiply-adds
   of x and W; the + 128 comes off as 128 * wsum[n] (each channel's sum of q, computed
   once at load). The sums are exact int32, so they equal torch._int_mm's bit for bit.
   The register tile is up to 4 rows of x by 4 rows of W (16 accumulators, 8 loads per
   16 VNNI; 1-2 rows of x take 8 rows of W), k in steps of 64, and the 16 partial-sum
   vectors are reduced together at the end (a transpose-and-add, ~3 instructions an
   output, against K / 64 VNNI). A pool task is 64-256 output rows (i8_rows_a_task) for a
   chunk of rows of x small enough to stay in L2 (I8_MC_BYTES), so W's rows (in L1) meet
   every row of x in the chunk before the next rows of W are read. */
#define I8_NC_MIN 64             /* output rows a task, at least */
#define I8_NC_MAX 256            /* and at most */
#define I8_PF_ROWS 12            /* W prefetched this many rows ahead, into L2 */
#define I8_MC_BYTES (256 * 1024) /* rows of x a task: their u8 copy within this */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VNNI 1
/* lane i of the result = the sum of a[i]'s 16 lanes */
static inline __attribute__((always_inline)) __m512i reduce16(const __m512i *a) {
    __m512i b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                                _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * i], c[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(c[2 * i], c[2 * i + 1], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(d[0], d[1], 0x88),
                            _mm512_shuffle_i32x4(d[0], d[1], 0xdd));
}

/* acc += u (u8) . s (s8), 4 bytes a lane: in asm so that the accumulator stays in its
   register (through the intrinsic GCC copied every accumulator each step) */
static inline __attribute__((always_inline)) __m512i dp(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* out[m * ldo + n] = xu row m . w row n (raw: x + 128) for m < MR, n < NR (MR NR <= 16,
   NR 4 or 8); the last, partial step of 64 columns reads W through a mask */
static inline __attribute__((always_inline)) void i8_step(__m512i *acc, const uint8_t *xu,
                                                          long ldq, const int8_t *w, long K,
                                                          long k, __mmask64 mask, int pf,
                                                          const long MR, const long NR) {
    __m512i wv[8];
    if (pf) /* the same columns of W I8_PF_ROWS rows on, into L2: from DRAM, 32 rows on took
               M=16 from 100 to 147 GMAC/s (prefetcht0 one block ahead: no gain); 12 rows
               rather than 32 took a 246M decode step (16 rows, 2 threads, 256-row tasks)
               from 20.8 to 19.1-19.3 ms: a task's first rows are the ones nobody prefetched */
        for (long n = 0; n < NR; n++)
            _mm_prefetch((const char *)(w + (n + I8_PF_ROWS) * K + k), _MM_HINT_T2);
    for (long n = 0; n < NR; n++) wv[n] = _mm512_maskz_loadu_epi8(mask, w + n * K + k);
    for (long m = 0; m < MR; m++) {
        __m512i xv = _mm512_loadu_si512(xu + m * ldq + k);
        for (long n = 0; n < NR; n++)
            acc[m * NR + n] = dp(acc[m * NR + n], xv, wv[n]);
    }
}

static inline __attribute__((always_inline)) void i8_micro(const uint8_t *xu, long ldq,
                                                           const int8_t *w, long K,
                                                           int32_t *out, long ldo, int pf,
                                                           const long MR, const long NR) {
    __m512i acc[16];
    for (long i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    long k = 0;
    for (; k + 64 <= K; k += 64) i8_step(acc, xu, ldq, w, K, k, ~(__mmask64)0, pf, MR, NR);
    if (k < K) i8_step(acc, xu, ldq, w, K, k, ((__mmask64)1 << (K - k)) - 1, pf, MR, NR);
    __m512i sums = reduce16(acc); /* lane m * NR + n */
    for (long m = 0; m < MR; m++) {
        if (NR == 4)
            _mm_storeu_si128((__m128i *)(out + m * ldo), _mm512_extracti32x4_epi32(sums, 0));
        else
            _mm256_storeu_si256((__m256i *)(out + m * ldo), _mm512_castsi512_si256(sums));
        sums = NR == 4 ? _mm512_alignr_epi32(sums, sums, 4) : _mm512_alignr_epi32(sums, sums, 8);
    }
}
#endif

/* the same raw sum, one at a time (no VNNI, and the tails) */
static int32_t i8_dot(const uint8_t *xu, const int8_t *w, long K) {
    int32_t s = 0;
    for (long k = 0; k < K; k++) s += (int32_t)xu[k] * (int32_t)w[k];
    return s;
}

typedef struct {
    const uint8_t *xu;
    long ldq, M, K;
    const int8_t *w;
    long N, mc, nc, tasks_n; /* rows of x a chunk, rows of W a task, tasks a chunk */
    int32_t *acc;        /* [M][N] raw sums */
    /* y != NULL: each task also turns its block of sums into y (i8_scale) */
    const int32_t *wsum;
    const float *xs, *scale, *bias;
    float *y;
} I8Job;

/* i8_quantize and i8_scale round as torch does (true division, round half to even,
   torch's order of products), so the C path and the torch._int_mm path give the same
   bits: fast-math's reciprocals and reassociation are off for them */
#define EXACT_MATH __attribute__((noinline, optimize("no-fast-math", "no-reciprocal-math", \
                                                    "no-associative-math")))
static EXACT_MATH void i8_scale(const int32_t *acc, long ld, long m0, long m1, long n0, long n1,
                                const int32_t *wsum, const float *xs, const float *scale,
                                const float *bias, float *y);

static void i8_task(void *ctx, long t) {
    const I8Job *J = ctx;
    long K = J->K, N = J->N, ldq = J->ldq;
    long c0 = t / J->tasks_n * J->mc, c1 = c0 + J->mc < J->M ? c0 + J->mc : J->M;
    long n0 = t % J->tasks_n * J->nc, n1 = n0 + J->nc < N ? n0 + J->nc : N;
    long n = n0;
#ifdef I8_VNNI
    for (; n + 8 <= n1; n += 8) { /* these 8 rows of W stay in L1 for the chunk's rows; */
        const int8_t *wn = J->w + n * K; /* the first tile prefetches W further on (short
                                             row streams: the prefetcher alone lagged) */
        const uint8_t *xu = J->xu + c0 * ldq;
        int32_t *acc = J->acc + c0 * N + n;
        long m = c0;
        for (; m + 4 <= c1; m += 4, xu += 4 * ldq, acc += 4 * N) {
            i8_micro(xu, ldq, wn, K, acc, N, m == c0, 4, 4);
            i8_micro(xu, ldq, wn + 4 * K, K, acc + 4, N, m == c0, 4, 4);
        }
        int pf = m == c0;
        switch (c1 - m) {
        case 3:
            i8_micro(xu, ldq, wn, K, acc, N, pf, 3, 4);
            i8_micro(xu, ldq, wn + 4 * K, K, acc + 4, N, pf, 3, 4);
            break;
        case 2: i8_micro(xu, ldq, wn, K, acc, N, pf, 2, 8); break;
        case 1: i8_micro(xu, ldq, wn, K, acc, N, pf, 1, 8); break;
        }
    }
#endif
    for (; n < n1; n++)
        for (long m = c0; m < c1; m++) J->acc[m * N + n] = i8_dot(J->xu + m * ldq, J->w + n * K, K);
    if (J->y) /* while the block's sums are in this core's cache, not after on one thread */
        i8_scale(J->acc, N, c0, c1, n0, n1, J->wsum, J->xs, J->scale, J->bias, J->y);
}

/* Rows of W a task: long runs, as each task's first I8_PF_ROWS rows come from DRAM
   unprefetched (a 246M decode step at 2 threads: 21.7 ms with 64 rows a task, 20.5 with
   256), but at least 4 tasks a thread, so a late worker leaves little to the caller. */
static long i8_rows_a_task(long N) {
    long nc = N / (4 * bs_get_threads()) / 8 * 8;
    return nc < I8_NC_MIN ? I8_NC_MIN : (nc > I8_NC_MAX ? I8_NC_MAX : nc);
}

/* acc [M][N] = the raw sums (x + 128) . w for xu [M][ldq] (ldq a multiple of 64); with
   y, also y = i8_scale(acc), block by block on the task that summed it */
static void i8_gemm_raw(const uint8_t *xu, long ldq, long M, long K, const int8_t *w, long N,
                        int32_t *acc, const int32_t *wsum, const float *xs, const float *scale,
                        const float *bias, float *y) {
    long mc = I8_MC_BYTES / ldq & ~3L;
    if (mc < 4) mc = 4;
    if (mc > M) mc = M;
    long nc = i8_rows_a_task(N);
    long tasks_n = (N + nc - 1) / nc, chunks = (M + mc - 1) / mc;
    I8Job job = {xu, ldq, M, K, w, N, mc, nc, tasks_n, acc, wsum, xs, scale, bias, y};
    bs_parallel(i8_task, &job, chunks * tasks_n);
}

/* this thread's scratch, grown once and kept (a fresh malloc of a few MiB is fresh pages:
   their faults cost more than a head's GEMM at 16 rows) */
static __thread void *i8_scratch;
static __thread size_t i8_scratch_len;

/* x's u8 copy [M][ldq] (zeroed tail) and `extra` bytes after it, 64-byte aligned */
static uint8_t *i8_buffer(long M, long K, long *ldq, size_t extra) {
    *ldq = (K + 63) / 64 * 64;
    size_t need = (size_t)(M * *ldq) + extra + 64;
    if (i8_scratch_len < need) {
        free(i8_scratch);
        i8_scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        i8_scratch_len = i8_scratch ? need : 0;
    }
    uint8_t *xu = (uint8_t *)i8_scratch;
    if (*ldq > K)
        for (long m = 0; m < M; m++) memset(xu + m * *ldq + K, 0, (size_t)(*ldq - K));
    return xu;
}

void bs_i8_gemm(const int8_t *x, long ldx, long M, long K, const int8_t *w, const int32_t *wsum,
                long N, int32_t *y) {
    long ldq;
    uint8_t *xu = i8_buffer(M, K, &ldq, 0);
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) xu[m * ldq + k] = (uint8_t)(x[m * ldx + k] ^ 0x80);
    i8_gemm_raw(xu, ldq, M, K, w, N, y, NULL, NULL, NULL, NULL, NULL);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) y[m * N + n] -= 128 * wsum[n];
}

/* x rounded per row exactly as quantize_activations does in torch (see EXACT_MATH) */
static EXACT_MATH void i8_quantize(const float *x, long ldx, long M, long K, uint8_t *xu,
                                   long ldq, float *xs) {
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        long k = 0;
        float amax = 0.f;
#ifdef I8_VNNI /* 16 at a time: the same IEEE division and round-half-even as the loop */
        __m512 vmax = _mm512_setzero_ps();
        for (; k < K; k += 16) {
            __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, xm + k)));
        }
        amax = _mm512_reduce_max_ps(vmax);
        k = 0;
#else
        for (; k < K; k++) amax = fabsf(xm[k]) > amax ? fabsf(xm[k]) : amax;
        k = 0;
#endif
        float scale = (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
        xs[m] = scale;
#ifdef I8_VNNI
        const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f);
        const __m512 hi = _mm512_set1_ps(127.f);
        for (; k + 16 <= K; k += 16) {
            __m512 q = _mm512_div_ps(_mm512_loadu_ps(xm + k), vs);
            q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
            __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i *)(xu + m * ldq + k), _mm512_cvtepi32_epi8(v));
        }
#endif
        for (; k < K; k++) {
            float q = nearbyintf(xm[k] / scale);
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            xu[m * ldq + k] = (uint8_t)((int)q + 128);
        }
    }
}

/* y = (float)(int32 sum) * xs[m] * scale[n] (+ bias), in torch's order of roundings, for
   rows m0 .. m1 and columns n0 .. n1 of acc and y (row stride ld) */
static EXACT_MATH void i8_scale(const int32_t *acc, long ld, long m0, long m1, long n0, long n1,
                                const int32_t *wsum, const float *xs, const float *scale,
                                const float *bias, float *y) {
    for (long m = m0; m < m1; m++) {
        long n = n0;
#ifdef I8_VNNI
        const __m512 vx = _mm512_set1_ps(xs[m]);
        for (; n + 16 <= n1; n += 16) {
            __m512i d = _mm512_sub_epi32(_mm512_loadu_si512(acc + m * ld + n),
                                         _mm512_slli_epi32(_mm512_loadu_si512(wsum + n), 7));
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(d), vx);
            v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + n));
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
            _mm512_storeu_ps(y + m * ld + n, v);
        }
#endif
        for (; n < n1; n++) {
            float v = (float)(acc[m * ld + n] - 128 * wsum[n]) * xs[m];
            v = v * scale[n];
            y[m * ld + n] = bias ? v + bias[n] : v;
        }
    }
}

typedef struct {
    const float *x;
    long ldx, M, K;
    uint8_t *xu;
    long ldq;
    float *xs;
    long per;
} QuantJob;

static void quantize_task(void *ctx, long t) {
    const QuantJob *J = ctx;
    long m0 = t * J->per, m1 = m0 + J->per < J->M ? m0 + J->per : J->M;
    i8_quantize(J->x + m0 * J->ldx, J->ldx, m1 - m0, J->K, J->xu + m0 * J->ldq, J->ldq, J->xs + m0);
}

/* i8_quantize over the pool in blocks of rows when there are many (a prompt's); a row's
   rounding is the same whichever thread does it */
static void i8_quantize_rows(const float *x, long ldx, long M, long K, uint8_t *xu, long ldq,
                             float *xs) {
    long per = (M + 4 * bs_get_threads() - 1) / (4 * bs_get_threads());
    QuantJob job = {x, ldx, M, K, xu, ldq, xs, per < 32 ? 32 : per};
    bs_parallel(quantize_task, &job, (M + job.per - 1) / job.per);
}

/* y = x @ W.T (+ bias) with x rounded per row: Int8Linear's int8-activation path */
static void q8a8_gemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    long N = w->N, K = w->K, ldq;
    uint8_t *xu = i8_buffer(M, K, &ldq, sizeof(int32_t) * (size_t)(M * N + M));
    int32_t *acc = (int32_t *)(xu + M * ldq); /* M * ldq: a multiple of 64 */
    float *xs = (float *)(acc + M * N);
    i8_quantize_rows(x, ldx, M, K, xu, ldq, xs);
    i8_gemm_raw(xu, ldq, M, K, (const int8_t *)w->data, N, acc, w->wsum, xs, w->scale, w->bias,
                y);
}

typedef struct {
    const Weight *w;
    const float *x;
    long ldx, M;
    float *y;
} Q8Job;

#define Q8_NC 64 /* output rows a task of the fp32-x GEMV */

/* output rows [t * Q8_NC, (t + 1) * Q8_NC) of the fp32-x int8 GEMV (few rows of x) */
static void q8_task(void *ctx, long t) {
    const Q8Job *J = ctx;
    const Weight *w = J->w;
    const float *x = J->x;
    long ldx = J->ldx, M = J->M, N = w->N;
    float *y = J->y;
    long n1 = (t + 1) * Q8_NC < N ? (t + 1) * Q8_NC : N;
    for (long n = t * Q8_NC; n < n1; n++) {
        for (long m0 = 0; m0 < M; m0 += 4) {
            long R = M - m0 < 4 ? M - m0 : 4;
            const float *xm = x + m0 * ldx;
            float out[4];
#ifdef __AVX512F__
            if ((w->K & 15) == 0) {
                switch (R) {
                case 1: q8_tile(w, xm, ldx, n, out, 1); break;
                case 2: q8_tile(w, xm, ldx, n, out, 2); break;
                case 3: q8_tile(w, xm, ldx, n, out, 3); break;
                default: q8_tile(w, xm, ldx, n, out, 4); break;
                }
            } else
#endif
            {
                for (long r = 0; r < R; r++) q8_row_plain(w, xm + r * ldx, n, out + r);
            }
            float b = w->bias ? w->bias[n] : 0.f;
            for (long r = 0; r < R; r++) y[(m0 + r) * N + n] = out[r] * w->scale[n] + b;
        }
    }
}

void bs_qgemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    if (w->kind == 2) {
        q4t_gemv(w, x, ldx, M, y);
        return;
    }
    if (w->wsum != NULL && M >= w->a8_rows) {
        q8a8_gemv(w, x, ldx, M, y);
        return;
    }
    /* fp32 x (few rows, or weight-only int8): output rows split over the pool; each
       output is computed alike whichever thread takes it */
    Q8Job job = {w, x, ldx, M, y};
    bs_parallel(q8_task, &job, (w->N + Q8_NC - 1) / Q8_NC);
}
