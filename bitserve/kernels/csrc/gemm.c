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

/* Packed weights: panels of 16 output rows, P[N / 16][K][16] (N a multiple of 16), so
   one 64-byte load holds one column of 16 outputs. `bs_linear_packed` keeps a tile of up
   to 12 rows of x by 32 outputs in 24 accumulators: per column, 2 weight loads and 12
   broadcasts of x feed 24 FMAs, no horizontal sums, and each output's sum runs in k
   order whatever the tile, so a row's result does not depend on the rows batched with
   it. Above 24 rows, the rows go in chunks of MC and the outputs in groups of NC panels
   (two panel pairs), with K in blocks of KC only beyond 2048: a panel pair's block
   (K x 32 floats, <= 256 KiB) stays in L2 while the chunk's 40 row tiles pass it, and
   each output is loaded and stored once per K block. Against L1-sized blocks (MC 120,
   NC 64, KC 256) this is 1.1-1.2x at 32-1600 rows on every Llama shape from 58M to 1B
   (215-230 GFLOP/s on one core, 0.9-0.97 of its FMA peak); below 24 rows each weight
   panel streams once, front to back.
   `python -m bench.kernels` measures it against torch. */
void bs_pack(const float *w, long N, long K, float *P) {
    for (long p = 0; p < N / 16; p++)
        for (long k = 0; k < K; k++)
            for (long j = 0; j < 16; j++) P[(p * K + k) * 16 + j] = w[(p * 16 + j) * K + k];
}

#ifdef __AVX512F__
#define PACKED_ROWS 12
#define PACKED_KC 2048
#define PACKED_MC 480 /* 40 tiles of 12 rows */
#define PACKED_NC 4   /* panels: 64 outputs, y 480 x 64 floats, 120 KiB */
#define PACKED_PREFETCH 64 /* columns */

/* rows r < R of x, columns k0 .. k1, against panels P0 (and P1 when NP is 2) */
static inline __attribute__((always_inline)) void packed_tile(
    const float *x, long ldx, long k0, long k1, const float *P0, const float *P1, float *y,
    long ldy, const float *b0, const float *b1, int first, const long R, const int NP) {
    __m512 acc[PACKED_ROWS][2];
    for (long r = 0; r < R; r++) {
        acc[r][0] = first ? (b0 ? _mm512_loadu_ps(b0) : _mm512_setzero_ps())
                          : _mm512_loadu_ps(y + r * ldy);
        if (NP == 2)
            acc[r][1] = first ? (b1 ? _mm512_loadu_ps(b1) : _mm512_setzero_ps())
                              : _mm512_loadu_ps(y + r * ldy + 16);
    }
    const float *p0 = P0 + k0 * 16, *p1 = P1 + k0 * 16;
    for (long k = k0; k < k1; k++, p0 += 16, p1 += 16) {
        /* 4 KiB ahead in each panel: the hardware prefetcher alone left a weight stream
           from DRAM short of requests in flight (1.2-1.5x at 1-24 rows, same at 1600) */
        _mm_prefetch((const char *)(p0 + 16 * PACKED_PREFETCH), _MM_HINT_T0);
        if (NP == 2) _mm_prefetch((const char *)(p1 + 16 * PACKED_PREFETCH), _MM_HINT_T0);
        __m512 w0 = _mm512_loadu_ps(p0);
        __m512 w1 = NP == 2 ? _mm512_loadu_ps(p1) : w0;
        for (long r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(w0, xb, acc[r][0]);
            if (NP == 2) acc[r][1] = _mm512_fmadd_ps(w1, xb, acc[r][1]);
        }
    }
    for (long r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        if (NP == 2) _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

#define PACKED_CASE(n)                                                                       \
    case n:                                                                                  \
        if (np == 2)                                                                         \
            packed_tile(xm, ldx, k0, k1, P0, P1, ym, N, b0, b1, first, n, 2);               \
        else                                                                                 \
            packed_tile(xm, ldx, k0, k1, P0, P1, ym, N, b0, b1, first, n, 1);               \
        break;

/* Panels [p0, p1) (p0 even) of y = x @ W.T + b, for rows 0 .. M - 1: one task. Kept a
   function of its own (noinline): outlined into an OpenMP region it ran ~25% slower. */
static __attribute__((noinline)) void packed_panels(const float *x, long ldx, long M, long K,
                                                    const float *P, long N, const float *b,
                                                    float *y, long p0, long p1) {
    long kc = M <= 2 * PACKED_ROWS ? K : PACKED_KC;
    /* rows in chunks of PACKED_MC, outputs in groups of PACKED_NC panels: a panel pair's
       K block stays in L2 while the chunk's row tiles pass it */
    long nc = M <= 2 * PACKED_ROWS ? p1 - p0 : PACKED_NC;
    for (long c0 = 0; c0 < M; c0 += PACKED_MC) {
        long mc = M - c0 < PACKED_MC ? M - c0 : PACKED_MC;
        long blocks = (mc + PACKED_ROWS - 1) / PACKED_ROWS, rb = (mc + blocks - 1) / blocks;
        for (long g0 = p0; g0 < p1; g0 += nc) {
            long g1 = g0 + nc < p1 ? g0 + nc : p1;
            for (long k0 = 0; k0 < K; k0 += kc) {
                long k1 = k0 + kc < K ? k0 + kc : K;
                int first = k0 == 0;
                for (long p = g0; p < g1; p += 2) {
                    int np = p + 1 < g1 ? 2 : 1;
                    const float *P0 = P + p * K * 16, *P1 = P0 + K * 16;
                    const float *b0 = b ? b + p * 16 : NULL;
                    const float *b1 = b && np == 2 ? b + p * 16 + 16 : NULL;
                    for (long m = c0; m < c0 + mc; m += rb) {
                        long R = c0 + mc - m < rb ? c0 + mc - m : rb;
                        const float *xm = x + m * ldx;
                        float *ym = y + m * N + p * 16;
                        switch (R) {
                            PACKED_CASE(1) PACKED_CASE(2) PACKED_CASE(3) PACKED_CASE(4)
                            PACKED_CASE(5) PACKED_CASE(6) PACKED_CASE(7) PACKED_CASE(8)
                            PACKED_CASE(9) PACKED_CASE(10) PACKED_CASE(11) PACKED_CASE(12)
                        }
                    }
                }
            }
        }
    }
}

/* One task of a packed GEMM on the pool: with few rows, a range of `per` panels for
   every row (each thread streams its own weights); with many, one chunk of PACKED_MC rows
   against one group of `per` panels (chunk-major, so a chunk's x is read while warm). */
typedef struct {
    const float *x;
    long ldx, M, K;
    const float *P;
    long N;
    const float *b;
    float *y;
    long per, groups; /* panels a task; panel groups a row chunk (0: every row a task) */
} Packed;

static void packed_task(void *job, long t) {
    const Packed *J = job;
    long panels = J->N / 16, c0 = 0, M = J->M, g = t;
    if (J->groups) {
        c0 = t / J->groups * PACKED_MC, g = t % J->groups;
        M = J->M - c0 < PACKED_MC ? J->M - c0 : PACKED_MC;
    }
    long p0 = g * J->per, p1 = p0 + J->per < panels ? p0 + J->per : panels;
    packed_panels(J->x + c0 * J->ldx, J->ldx, M, J->K, J->P, J->N, J->b, J->y + c0 * J->N, p0,
                  p1);
}
#endif

int bs_packed_vectorised(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

void bs_linear_packed(const float *x, long ldx, long M, long K, const float *P, long N,
                      const float *b, float *y) {
    long panels = N / 16;
#ifdef __AVX512F__
    if (bs_get_threads() == 1) {
        packed_panels(x, ldx, M, K, P, N, b, y, 0, panels);
        return;
    }
    Packed job = {x, ldx, M, K, P, N, b, y, PACKED_NC, 0};
    long tasks;
    if (M <= 2 * PACKED_ROWS) { /* ~256 KiB of weights a task, in whole panel pairs */
        long pairs = (256 * 1024) / (32 * K * (long)sizeof(float));
        job.per = 2 * (pairs > 1 ? pairs : 1);
        tasks = (panels + job.per - 1) / job.per;
    } else {
        job.groups = (panels + PACKED_NC - 1) / PACKED_NC;
        tasks = (M + PACKED_MC - 1) / PACKED_MC * job.groups;
    }
    bs_parallel(packed_task, &job, tasks);
#else
    for (long m = 0; m < M; m++)
        for (long p = 0; p < panels; p++)
            for (long j = 0; j < 16; j++) {
                float s = b ? b[p * 16 + j] : 0.f;
                for (long k = 0; k < K; k++) s += P[(p * K + k) * 16 + j] * x[m * ldx + k];
                y[m * N + p * 16 + j] = s;
            }
#endif
}
