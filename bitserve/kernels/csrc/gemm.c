/* fp32 y = x @ W.T (+ b) for decode and small models' prefill: `bs_linear`.

   MKL's fp32 GEMV streams weights at about half of what a plain sum reads on this CPU;
   this loop streams each weight row once, for all rows of x, at close to the read
   bandwidth. From 4 rows up a 4x4 register tile keeps the FMA units busy instead.
   Measured by `python -m bench.llm_throughput --kernels`. */
#include "internal.h"

#ifdef __AVX512F__
/* From 4 rows of x up, a 4x4 register tile: 4 weight rows against 4 rows of x, 16
   accumulators, 8 loads per 16 FMAs, so the loop is bound by the FMA units instead of
   by loads; each weight row block is reused from L1 for every 4 rows of x. At 16-64
   rows it is ~1.4x MKL's sgemm on one core (MKL's small-M path is weak), and it is
   what keeps batched decode ahead of llama.cpp. */
static inline void tile4x4(const float *x, long ldx, long K, const float *w, long N,
                           const float *b, float *y) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        __m512 xv[4];
        for (int j = 0; j < 4; j++) xv[j] = _mm512_loadu_ps(x + j * ldx + k);
        for (int i = 0; i < 4; i++) {
            __m512 wv = _mm512_loadu_ps(w + i * K + k);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(wv, xv[j], a[i][j]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) y[j * N + i] = _mm512_reduce_add_ps(a[i][j]) + (b ? b[i] : 0.f);
}

static inline void tile4x1(const float *x, long K, const float *w, const float *b, float *y) {
    __m512 a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        __m512 xv = _mm512_loadu_ps(x + k);
        for (int i = 0; i < 4; i++)
            a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i * K + k), xv, a[i]);
    }
    for (int i = 0; i < 4; i++) y[i] = _mm512_reduce_add_ps(a[i]) + (b ? b[i] : 0.f);
}

static void linear_tiled_rows(const float *x, long ldx, long M, long K, const float *w, long N,
                              const float *b, float *y) {
    long n = 0;
    for (; n + 4 <= N; n += 4) {
        const float *wn = w + n * K, *bn = b ? b + n : NULL;
        long m = 0;
        for (; m + 4 <= M; m += 4) tile4x4(x + m * ldx, ldx, K, wn, N, bn, y + m * N + n);
        for (; m < M; m++) tile4x1(x + m * ldx, K, wn, bn, y + m * N + n);
    }
    for (; n < N; n++)
        for (long m = 0; m < M; m++)
            y[m * N + n] = dot(w + n * K, x + m * ldx, K) + (b ? b[n] : 0.f);
}

/* Many rows (prefill, big batches): blocks of rows whose x stays in half the L2, so the
   tile reads x from L2 while the weights stream once per block. */
static void linear_tiled(const float *x, long ldx, long M, long K, const float *w, long N,
                         const float *b, float *y) {
    long block = ((128 * 1024) / K) & ~3L;
    if (block < 4) block = 4;
    for (long m = 0; m < M; m += block)
        linear_tiled_rows(x + m * ldx, ldx, M - m < block ? M - m : block, K, w, N, b, y + m * N);
}
#endif

void bs_linear(const float *x, long ldx, long M, long K, const float *w, long N,
                     const float *b, float *y) {
#ifdef __AVX512F__
    if (M >= 4 && (K & 15) == 0) {
        linear_tiled(x, ldx, M, K, w, N, b, y);
        return;
    }
#endif
    for (long n = 0; n < N; n++) {
        const float *wn = w + n * K;
        float bn = b ? b[n] : 0.f;
        for (long m = 0; m < M; m++) y[m * N + n] = dot(wn, x + m * ldx, K) + bn;
    }
}
