/* LoRA deltas for a step whose rows use different adapters (bitserve/llm/lora.py):
   y[m] += Bt[s]^T (A[s] x[m]) for each row m whose slot s = slots[m] is >= 0, in one
   call per linear layer whatever the mix, where torch needs an index_select, two small
   matmuls and an index_add per adapter in the step (the fused decode layer calls it
   from bs_gemv, so a decode step with adapters stays one C call per layer).

   A [S, W, K] and Bt [S, W, N] are the slots' stacks, W rank columns a slot; a column
   whose product is 0 (an adapter's rank below W, a part it does not target: zero rows of
   A) is skipped. A slot's rows are taken together: each A row is dotted with all of
   them while it is in L1, and Bt is read in column tiles that stay in L1 for every row,
   so a slot's A and Bt come from memory once per call, not once per row. */
#include "internal.h"

#define TILE 128 /* Bt columns a pass: W x TILE floats stay in L1 for every row */

static void slot_rows(const float *x, long ldx, long K, const long *rows, long n, const float *a,
                      const float *bt, long W, long N, float *y, long ldy, float *xa) {
    for (long w = 0; w < W; w++)
        for (long i = 0; i < n; i++) xa[i * W + w] = dot(a + w * K, x + rows[i] * ldx, K);
    for (long n0 = 0; n0 < N; n0 += TILE) {
        long nb = N - n0 < TILE ? N - n0 : TILE;
        for (long i = 0; i < n; i++) {
            float *ym = y + rows[i] * ldy + n0;
#ifdef __AVX512F__
            if (nb == TILE) { /* the row's tile in 8 registers across every w */
                __m512 acc[TILE / 16];
                for (int v = 0; v < TILE / 16; v++) acc[v] = _mm512_loadu_ps(ym + 16 * v);
                for (long w = 0; w < W; w++) {
                    const float c = xa[i * W + w], *b = bt + w * N + n0;
                    if (c == 0.f) continue;
                    __m512 cv = _mm512_set1_ps(c);
                    for (int v = 0; v < TILE / 16; v++)
                        acc[v] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(b + 16 * v), acc[v]);
                }
                for (int v = 0; v < TILE / 16; v++) _mm512_storeu_ps(ym + 16 * v, acc[v]);
                continue;
            }
#endif
            for (long w = 0; w < W; w++) {
                const float c = xa[i * W + w], *b = bt + w * N + n0;
                if (c == 0.f) continue;
#pragma omp simd
                for (long j = 0; j < nb; j++) ym[j] += c * b[j];
            }
        }
    }
}

void bs_lora_add(const float *x, long ldx, long M, long K, const int *slots, const float *A,
                 const float *Bt, long S, long W, long N, float *y, long ldy) {
    long *rows = malloc(sizeof(long) * (M > 0 ? M : 1));
    float *xa = malloc(sizeof(float) * (M * W > 0 ? M * W : 1));
    if (!rows || !xa) abort();
    for (long s = 0; s < S; s++) {
        long n = 0;
        for (long m = 0; m < M; m++)
            if (slots[m] == s) rows[n++] = m;
        if (n) slot_rows(x, ldx, K, rows, n, A + s * W * K, Bt + s * W * N, W, N, y, ldy, xa);
    }
    free(rows);
    free(xa);
}
