/* LoRA deltas for a step whose rows use different adapters (bitserve/llm/lora.py):
   y[i] += Bt[s]^T (A[s] x[i]) for each row i whose slot s = slots[i] is >= 0, in one
   call per linear layer whatever the mix, where torch needs an index_select, two small
   matmuls and an index_add per adapter in the step. A [S, W, K] and Bt [S, W, N] are the
   slots' stacks (W rank columns a slot; zero rows where an adapter's rank is below W or a
   part is not targeted: skipped, their product being 0). Rows of one slot are taken
   together so its A and Bt stay in cache. */
#include "internal.h"

void bs_lora_add(const float *x, long ldx, long M, long K, const int *slots, const float *A,
                 const float *Bt, long S, long W, long N, float *y, long ldy) {
    float xa[W > 0 ? W : 1];
    for (long s = 0; s < S; s++) {
        const float *a = A + s * W * K, *bt = Bt + s * W * N;
        for (long m = 0; m < M; m++) {
            if (slots[m] != s) continue;
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy;
            for (long w = 0; w < W; w++) xa[w] = dot(a + w * K, xm, K);
            for (long w = 0; w < W; w++) {
                if (xa[w] == 0.f) continue;
                const float c = xa[w], *b = bt + w * N;
#pragma omp simd
                for (long n = 0; n < N; n++) ym[n] += c * b[n];
            }
        }
    }
}
