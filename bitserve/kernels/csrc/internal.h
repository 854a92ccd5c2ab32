/* What the kernel files share but do not export: one dot product, the strided paged
   attention and the quantized GEMV that the decode layer calls. */
#ifndef BITSERVE_INTERNAL_H
#define BITSERVE_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bitserve.h"

/* y[m, n] = sum_k x[m, k] * w[n, k] + b[n]; x [M, K] (row stride ldx), w [N, K]
   contiguous, y [M, N] contiguous. One weight row at a time, read front to back (the
   hardware prefetcher's best case: this reaches the plain-sum read bandwidth, where
   interleaving several rows or software prefetch lost 15-25%), reused from L1 for
   every row of x. */
static inline float dot(const float *a, const float *b, long K) {
#ifdef __AVX512F__
    if ((K & 31) == 0) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (long k = 0; k < K; k += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), s1);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#endif
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long k = 0; k < K; k++) s += a[k] * b[k];
    return s;
}

/* pool.c: run fn(ctx, 0) .. fn(ctx, n - 1) on the pool (any order, any thread, each once;
   returns when all are done), and how many threads the pool has (bs_set_threads) */
typedef void (*bs_task)(void *ctx, long i);
void bs_parallel(bs_task fn, void *ctx, long n);
long bs_get_threads(void);

/* bs_paged_decode with row strides for q (ldq) and out (ldo): the decode layer reads q
   straight out of its fused qkv rows. */
void bs_attend(const float *q, long ldq, float *out, long ldo, const int *rows, long B, long Hq,
               long Hkv, long D, const float *kpool, const float *vpool, long nblk, long bs,
               const int *tables, long max_blocks, const int *lens, float scale, long window,
               float softcap);

/* y = x @ dequant(W).T + bias for int8 (kind 1) and int4 (kind 2) weights (qgemm.c) */
void bs_qgemv(const Weight *w, const float *x, long ldx, long M, float *y);

/* y = x @ W.T + bias for bf16 weights (kind 5, bf16.c) */
void bs_bf16_gemv(const Weight *w, const float *x, long ldx, long M, float *y);

#endif
