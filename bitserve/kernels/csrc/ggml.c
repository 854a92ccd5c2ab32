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

   - Few rows of x (decode, M < PANEL_ROWS): a weight row is dequantized into an L1
     buffer once and dotted with every row of x (read front to back, as bs_linear does).
   - More rows (batched decode, prefill): 32 output rows at a time are dequantized into
     bs_pack's panel layout (32 K floats, in L2) and run through the packed fp32 tile,
     so dequantization is paid once per weight per call, not once per row of x.
     (bs_linear_packed called from a pool task runs on that thread: the pool does not nest.)
   Either splits the output rows over the thread pool in chunks of CHUNK rows; each
   thread keeps its own scratch (thread-local, grown once, never freed). */
#include "internal.h"

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

#define CHUNK 32      /* output rows a task (two packed panels) */
#define PANEL_ROWS 4  /* from this many rows of x on, the panel path */

/* IEEE half -> float, exactly (normals, subnormals, inf, nan) */
static inline float fp16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
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
} Job;

/* rows n0 .. n1 - 1 of part `p` (whose first output column is col) */
static void part_rows(const Job *J, const GgmlPart *p, long col, long n0, long n1) {
    long K = J->w->K, N = J->w->N, M = J->M, rb = bs_ggml_row_bytes(p->type, K);
    const uint8_t *data = (const uint8_t *)p->data;
    if (M < PANEL_ROWS) {
        float *row = scratch(K);
        for (long n = n0; n < n1; n++) {
            deq_row(p->type, data + n * rb, K, row);
            for (long m = 0; m < M; m++) J->y[m * N + col + n] = dot(row, J->x + m * J->ldx, K);
        }
        return;
    }
    long R = n1 - n0, Rp = (R + 15) / 16 * 16;
    float *rows = scratch(Rp * K + Rp * K + M * Rp), *panels = rows + Rp * K, *out = panels + Rp * K;
    for (long n = n0; n < n1; n++) deq_row(p->type, data + n * rb, K, rows + (n - n0) * K);
    memset(rows + R * K, 0, sizeof(float) * (Rp - R) * K);
    bs_pack(rows, Rp, K, panels);
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
    for (long i = 0; i < w->nparts; i++) tasks += (parts[i].rows + CHUNK - 1) / CHUNK;
    Job job = {w, x, ldx, M, y};
    bs_parallel(ggml_task, &job, tasks);
    if (w->bias)
        for (long m = 0; m < M; m++)
            for (long n = 0; n < w->N; n++) y[m * w->N + n] += w->bias[n];
}
