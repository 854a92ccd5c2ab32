/* bf16 weights, fp32 activations and fp32 accumulation: kind 5 of `Weight`.

   Decode reads every weight once a token, so bf16 weights halve fp32's bytes. They are
   packed in panels of 16 output rows with pairs of columns interleaved (`bs_bf16_pack`):
   P[N16 / 16][K2][16][2], N16 = N rounded up to 16, K2 = ceil(K / 2), padding zero. One
   64-byte load holds columns k, k + 1 of 16 outputs, each 32-bit lane one output row, so
   a broadcast of x meets 16 outputs and nothing needs a horizontal sum. Two inner loops
   read the same panels (`bs_bf16_mode`):
   - widen (any AVX-512): a shift and an and split the pair into two fp32 vectors in
     registers (bf16 is the top half of an fp32) that meet x[k] and x[k + 1] in FMAs. The
     products are exact and x is untouched: the result is fp32 matmul on the bf16
     weights up to summation order.
   - dpbf16 (avx512_bf16): x is rounded to bf16 once per call and one `vdpbf16ps` takes
     both columns: half the instructions, but each x loses 16 bits of mantissa (a
     relative error up to 2^-9 per element, which averages down over K).
   Each output's sum runs in k order whatever the tile, so a row's result does not depend
   on the rows batched with it. Rows go in chunks of BF16_MC against every panel pair of
   the task, so a pair (K x 64 bytes) is read from memory once per chunk and from L2 by
   the chunk's tiles of up to BF16_ROWS rows. Measured by `python -m bench.quant`. */
#include "internal.h"

#define BF16_ROWS 12       /* rows of x a tile (vdpbf16ps: 24 accumulators) */
#define BF16_WIDEN_ROWS 6  /* widen: 24 accumulators, even and odd columns apart */
#define BF16_MC 48

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_DOT_BUILT 1
#else
#define BF16_DOT_BUILT 0
#endif

static long bf16_dot = BF16_DOT_BUILT; /* 1: vdpbf16ps, 0: widen and FMA */

long bs_bf16_mode(long mode) {
    if (mode >= 0) bf16_dot = mode && BF16_DOT_BUILT;
    return bf16_dot;
}

void bs_bf16_pack(const uint16_t *w, long N, long K, uint16_t *P) {
    long K2 = (K + 1) / 2, N16 = (N + 15) / 16 * 16;
    for (long n = 0; n < N16; n++)
        for (long k = 0; k < 2 * K2; k++) {
            uint16_t v = n < N && k < K ? w[n * K + k] : 0;
            P[((n / 16 * K2 + k / 2) * 16 + n % 16) * 2 + k % 2] = v;
        }
}

static inline uint16_t to_bf16(float f) { /* round to nearest even (x is finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

typedef struct {
    const Weight *w;
    const float *x;
    long ldx, M;
    const uint32_t *xb; /* dpbf16: x as bf16 pairs [M][K2], else NULL */
    float *y;
    long per, groups; /* panels a task; panel groups a row chunk */
} Bf16Job;

#ifdef __AVX512F__
/* rows r < R from m of x against panels p (and p + 1 when NP is 2) -> y */
static inline __attribute__((always_inline)) void bf16_tile(const Bf16Job *J, long m, long p,
                                                            const long R, const int NP) {
    const Weight *w = J->w;
    long K = w->K, K2 = (K + 1) / 2, N = w->N;
    const uint16_t *P0 = (const uint16_t *)w->data + p * K2 * 32, *P1 = P0 + K2 * 32;
    __mmask16 mask[2];
    __m512 acc[BF16_ROWS][2];
    for (int j = 0; j < NP; j++) {
        long left = N - (p + j) * 16;
        mask[j] = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        __m512 b = w->bias ? _mm512_maskz_loadu_ps(mask[j], w->bias + (p + j) * 16)
                           : _mm512_setzero_ps();
        for (long r = 0; r < R; r++) acc[r][j] = b;
    }
#if BF16_DOT_BUILT
    if (J->xb) {
        for (long k2 = 0; k2 < K2; k2++) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(P0 + k2 * 32);
            __m512bh w1 = NP == 2 ? (__m512bh)_mm512_loadu_si512(P1 + k2 * 32) : w0;
            for (long r = 0; r < R; r++) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)J->xb[(m + r) * K2 + k2]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xv);
                if (NP == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xv);
            }
        }
    } else
#endif
    {   /* even and odd columns in accumulators of their own: two FMA chains, not one
           twice as long (one row was bound by FMA latency at 0.6x the read rate) */
        __m512 odd[BF16_ROWS][2];
        for (long r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) odd[r][j] = _mm512_setzero_ps();
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (long k2 = 0; k2 < K2; k2++) {
            __m512 we[2], wo[2];
            for (int j = 0; j < NP; j++) {
                __m512i v = _mm512_loadu_si512((j ? P1 : P0) + k2 * 32);
                we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); /* column 2 k2 */
                wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high)); /* 2 k2 + 1 */
            }
            long k = 2 * k2;
            for (long r = 0; r < R; r++) {
                const float *xr = J->x + (m + r) * J->ldx;
                __m512 xe = _mm512_set1_ps(xr[k]);
                __m512 xo = _mm512_set1_ps(k + 1 < K ? xr[k + 1] : 0.f);
                for (int j = 0; j < NP; j++) {
                    acc[r][j] = _mm512_fmadd_ps(we[j], xe, acc[r][j]);
                    odd[r][j] = _mm512_fmadd_ps(wo[j], xo, odd[r][j]);
                }
            }
        }
        for (long r = 0; r < R; r++)
            for (int j = 0; j < NP; j++) acc[r][j] = _mm512_add_ps(acc[r][j], odd[r][j]);
    }
    for (long r = 0; r < R; r++)
        for (int j = 0; j < NP; j++)
            _mm512_mask_storeu_ps(J->y + (m + r) * N + (p + j) * 16, mask[j], acc[r][j]);
}

#define BF16_CASE(n)                                                                         \
    case n:                                                                                  \
        if (np == 2)                                                                         \
            bf16_tile(J, m, p, n, 2);                                                        \
        else                                                                                 \
            bf16_tile(J, m, p, n, 1);                                                        \
        break;

/* rows m0 .. m1 against panels p0 .. p1 (p0 even) */
static void bf16_block(const Bf16Job *J, long m0, long m1, long p0, long p1) {
    long most = J->xb ? BF16_ROWS : BF16_WIDEN_ROWS;
    long rows = m1 - m0, tiles = (rows + most - 1) / most;
    long rb = (rows + tiles - 1) / tiles; /* even tiles: 13 rows go 7 + 6, not 12 + 1 */
    for (long p = p0; p < p1; p += 2) {
        int np = p + 1 < p1 ? 2 : 1;
        for (long m = m0; m < m1; m += rb) {
            switch (m1 - m < rb ? m1 - m : rb) {
                BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
                BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
            }
        }
    }
}
#else
/* no AVX-512: the same panels, one output at a time */
static void bf16_block(const Bf16Job *J, long m0, long m1, long p0, long p1) {
    const Weight *w = J->w;
    long K = w->K, K2 = (K + 1) / 2, N = w->N;
    const uint16_t *P = (const uint16_t *)w->data;
    for (long m = m0; m < m1; m++)
        for (long n = p0 * 16; n < p1 * 16 && n < N; n++) {
            float s = w->bias ? w->bias[n] : 0.f;
            for (long k = 0; k < K; k++) {
                union { uint32_t u; float f; } c;
                c.u = (uint32_t)P[((n / 16 * K2 + k / 2) * 16 + n % 16) * 2 + k % 2] << 16;
                s += c.f * J->x[m * J->ldx + k];
            }
            J->y[m * N + n] = s;
        }
}
#endif

static void bf16_task(void *job, long t) {
    const Bf16Job *J = job;
    long chunk = t / J->groups, g = t % J->groups, panels = (J->w->N + 15) / 16;
    long m0 = chunk * BF16_MC, m1 = m0 + BF16_MC < J->M ? m0 + BF16_MC : J->M;
    long p0 = g * J->per, p1 = p0 + J->per < panels ? p0 + J->per : panels;
    bf16_block(J, m0, m1, p0, p1);
}

/* x quantized to bf16 pairs for vdpbf16ps (column K of an odd K pairs with a zero) */
static uint32_t *bf16_pairs(const float *x, long ldx, long M, long K) {
    long K2 = (K + 1) / 2;
    uint32_t *xb = (uint32_t *)malloc(sizeof(uint32_t) * M * K2);
    for (long m = 0; m < M; m++)
        for (long k2 = 0; k2 < K2; k2++) {
            long k = 2 * k2;
            uint32_t lo = to_bf16(x[m * ldx + k]), hi = k + 1 < K ? to_bf16(x[m * ldx + k + 1]) : 0;
            xb[m * K2 + k2] = lo | hi << 16;
        }
    return xb;
}

/* y [M, N] = x [M, K] (row stride ldx) @ W.T + bias for W packed by bs_bf16_pack. With
   threads, each task is one chunk of rows against a group of panel pairs of ~256 KiB. */
void bs_bf16_gemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    long panels = (w->N + 15) / 16, K2 = (w->K + 1) / 2;
    uint32_t *xb = bf16_dot ? bf16_pairs(x, ldx, M, w->K) : NULL;
    long per = 2 * ((256 * 1024) / (K2 * 128) > 1 ? (256 * 1024) / (K2 * 128) : 1);
    if (bs_get_threads() == 1) per = panels + 1;
    Bf16Job job = {w, x, ldx, M, xb, y, per, (panels + per - 1) / per};
    bs_parallel(bf16_task, &job, (M + BF16_MC - 1) / BF16_MC * job.groups);
    free(xb);
}
