/* A whole decoder layer for M decode rows in one call (`bs_decode_layer`), whatever its
   weights are (fp32, int8 or int4: `bs_gemv`), and prefill's elementwise steps. */
#include <stddef.h>

#include "internal.h"

void bs_gemv(const Weight *w, const float *x, long ldx, long M, float *y) {
    if (w->kind == 0)
        bs_linear(x, ldx, M, w->K, (const float *)w->data, w->N, w->bias, y);
    else if (w->kind == 3)
        bs_linear_packed(x, ldx, M, w->K, (const float *)w->data, w->N, w->bias, y);
    else if (w->kind == 5)
        bs_bf16_gemv(w, x, ldx, M, y);
    else if (w->kind == 4)
        bs_ggml_gemv(w, x, ldx, M, y);
    else
        bs_qgemv(w, x, ldx, M, y);
    if (w->lora_a)
        bs_lora_add(x, ldx, M, w->K, w->lora_slots, w->lora_a, w->lora_bt, w->lora_S, w->lora_W,
                    w->N, y, w->N);
}

static void rmsnorm(const float *x, const float *w, float *y, long M, long H, float eps) {
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * H;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (long h = 0; h < H; h++) ss += xm[h] * xm[h];
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (long h = 0; h < H; h++) y[m * H + h] = w[h] * (xm[h] * inv);
    }
}

static void rope(float *v, const float *c, const float *s, long D) {
    long half = D / 2;
    for (long i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* RoPE on the q and k heads of M decode rows of qkv [M, (Hq + 2 Hkv) D], then each row's
   k and v into its slot of the head-major pools (shared with the quantized layer). */
static void rope_and_store(float *qkv, long M, long Hq, long Hkv, long D, const int64_t *positions,
                           const float *cos, const float *sin, const int64_t *slots, float *kpool,
                           float *vpool, long nblk, long bs) {
    long QKV = (Hq + 2 * Hkv) * D;
    for (long m = 0; m < M; m++) {
        float *row = qkv + m * QKV;
        const float *c = cos + positions[m] * D, *s = sin + positions[m] * D;
        for (long hd = 0; hd < Hq + Hkv; hd++) rope(row + hd * D, c, s, D);
        long blk = slots[m] / bs, off = slots[m] % bs;
        for (long g = 0; g < Hkv; g++) {
            long dst = ((g * nblk + blk) * bs + off) * D;
            memcpy(kpool + dst, row + (Hq + g) * D, sizeof(float) * D);
            memcpy(vpool + dst, row + (Hq + Hkv + g) * D, sizeof(float) * D);
        }
    }
}

/* The layer's elementwise steps, row by row (a row's arithmetic is the same whichever
   thread runs it): on the pool in blocks of rows when a prefill brings many, on the
   caller when a decode step's rows are one block. */
typedef struct {
    const LayerParams *p;
    float *x, *h, *qkv, *gu, *act;
    const int64_t *positions, *slots;
} Rows;

typedef void (*row_fn)(const Rows *r, long lo, long hi);

typedef struct {
    row_fn fn;
    const Rows *rows;
    long M, per;
} RowJob;

static void row_task(void *job, long t) {
    const RowJob *J = job;
    long lo = t * J->per, hi = lo + J->per < J->M ? lo + J->per : J->M;
    J->fn(J->rows, lo, hi);
}

/* fn over M rows in tasks of at least `least` rows (fewer rows: on the caller) */
static void for_rows_of(row_fn fn, const Rows *rows, long M, long least) {
    long tasks = 4 * bs_get_threads(), per = (M + tasks - 1) / tasks;
    RowJob job = {fn, rows, M, per < least ? least : per};
    bs_parallel(row_task, &job, (M + job.per - 1) / job.per);
}

static void for_rows(row_fn fn, const Rows *rows, long M) { for_rows_of(fn, rows, M, 32); }

static void attn_norm(const Rows *r, long lo, long hi) {
    long H = r->p->H;
    rmsnorm(r->x + lo * H, r->p->ln1, r->h + lo * H, hi - lo, H, r->p->eps);
}

/* (qk-norm), RoPE, and K/V into the pool */
static void qk_rope_store(const Rows *r, long lo, long hi) {
    const LayerParams *p = r->p;
    long D = p->D, Hq = p->Hq, Hkv = p->Hkv, QKV = (Hq + 2 * Hkv) * D;
    if (p->qnorm)
        for (long m = lo; m < hi; m++) {
            float *row = r->qkv + m * QKV;
            for (long hd = 0; hd < Hq; hd++)
                rmsnorm(row + hd * D, p->qnorm, row + hd * D, 1, D, p->eps);
            for (long hd = Hq; hd < Hq + Hkv; hd++)
                rmsnorm(row + hd * D, p->knorm, row + hd * D, 1, D, p->eps);
        }
    rope_and_store(r->qkv + lo * QKV, hi - lo, Hq, Hkv, D, r->positions + lo, p->cos, p->sin,
                   r->slots + lo, p->kpool, p->vpool, p->nblk, p->bs);
}

/* x += h for rows lo .. hi, h RMSNorm-ed by `norm` first when there is one (Gemma) */
static void residual(const Rows *r, const float *norm, long lo, long hi) {
    long H = r->p->H;
    float *x = r->x + lo * H, *h = r->h + lo * H;
    if (norm) rmsnorm(h, norm, h, hi - lo, H, r->p->eps);
    for (long i = 0; i < (hi - lo) * H; i++) x[i] = x[i] + h[i];
}

/* (post-attention norm), residual, RMSNorm */
static void attn_residual(const Rows *r, long lo, long hi) {
    long H = r->p->H;
    residual(r, r->p->post_attn, lo, hi);
    rmsnorm(r->x + lo * H, r->p->ln2, r->h + lo * H, hi - lo, H, r->p->eps);
}

static void gated_act(const Rows *r, long lo, long hi) {
    long I = r->p->I;
    for (long m = lo; m < hi; m++) {
        const float *g = r->gu + m * 2 * I, *u = g + I;
        float *a = r->act + m * I;
        if (r->p->act == 1) /* tanh-GELU, torch's approximate="tanh" */
            for (long i = 0; i < I; i++) {
                float v = g[i], inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
                a[i] = (0.5f * v * (1.f + tanhf(inner))) * u[i];
            }
        else
            for (long i = 0; i < I; i++) a[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
    }
}

/* (post-MLP norm), residual */
static void mlp_residual(const Rows *r, long lo, long hi) { residual(r, r->p->post_mlp, lo, hi); }

/* bs_decode_layer: RMSNorm, fused qkv, (qk-norm), RoPE, K/V into the pool, paged
   attention, o_proj, (post-attention norm), residual, RMSNorm, fused gate/up, the gated
   activation, down, (post-MLP norm), residual. A step is one call a layer instead of ~60
   torch ops; its rows may be decodes or a prompt's (each attends its own context). */
void bs_decode_layer(const LayerParams *p, float *x, long M, const int64_t *positions,
                     const int64_t *slots, const int *rows, const int *tables, long max_blocks,
                     const int *lens, float *scratch) {
    long H = p->H, D = p->D, Hq = p->Hq, Hkv = p->Hkv, I = p->I;
    long QKV = (Hq + 2 * Hkv) * D;
    float *h = scratch, *qkv = h + M * H, *att = qkv + M * QKV, *gu = att + M * Hq * D,
          *act = gu + M * 2 * I;
    Rows r = {p, x, h, qkv, gu, act, positions, slots};
    for_rows(attn_norm, &r, M);
    bs_gemv(&p->qkv, h, H, M, qkv);
    for_rows(qk_rope_store, &r, M);
    bs_attend(qkv, QKV, att, Hq * D, rows, M, Hq, Hkv, D, p->kpool, p->vpool, p->nblk, p->bs,
              tables, max_blocks, lens, p->scale, p->window, p->softcap);
    bs_gemv(&p->o, att, Hq * D, M, h);
    for_rows(attn_residual, &r, M);
    bs_gemv(&p->gu, h, H, M, gu);
    for_rows_of(gated_act, &r, M, 4); /* (its expf: ~1 ms a 16-row step of 246M on one thread) */
    bs_gemv(&p->down, act, I, M, h);
    for_rows(mlp_residual, &r, M);
}

/* Prefill's elementwise steps in one pass each (torch makes 3-4 passes and temporaries):
   out[m] = silu(gate[m]) * up[m] for gu [M, 2I] (gate | up), and RoPE in place on the
   H heads of D at the start of each of T rows of x (row stride ld). */
void bs_silu_mul(const float *gu, long M, long I, float *out) {
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = out + m * I;
#pragma omp simd
        for (long i = 0; i < I; i++) o[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
    }
}

void bs_rope_rows(float *x, long T, long ld, long H, long D, const int64_t *positions,
                  const float *cos, const float *sin) {
    for (long t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (long h = 0; h < H; h++) rope(x + t * ld + h * D, c, s, D);
    }
}

#define FIELD(T, f) {#T, #f, (long)offsetof(T, f)}
#define SIZE(T) {#T, "", (long)sizeof(T)}
static const struct {
    const char *type, *field;
    long value;
} LAYOUT[] = {
    SIZE(Weight),           FIELD(Weight, kind),       FIELD(Weight, data),
    FIELD(Weight, scale),   FIELD(Weight, s4),         FIELD(Weight, bias),
    FIELD(Weight, N),       FIELD(Weight, K),          FIELD(Weight, Kp),
    FIELD(Weight, group),   FIELD(Weight, wsum),       FIELD(Weight, a8_rows),
    FIELD(Weight, lora_a),  FIELD(Weight, lora_bt),    FIELD(Weight, lora_slots),
    FIELD(Weight, lora_S),  FIELD(Weight, lora_W),     FIELD(Weight, perm),
    FIELD(Weight, parts),   FIELD(Weight, nparts),     SIZE(GgmlPart),
    FIELD(GgmlPart, type),  FIELD(GgmlPart, rows),     FIELD(GgmlPart, data),
    FIELD(GgmlPart, tiles), FIELD(GgmlPart, sz), FIELD(GgmlPart, group), FIELD(GgmlPart, bits),
    SIZE(LayerParams),      FIELD(LayerParams, qkv),   FIELD(LayerParams, o),
    FIELD(LayerParams, gu), FIELD(LayerParams, down),  FIELD(LayerParams, ln1),
    FIELD(LayerParams, ln2), FIELD(LayerParams, qnorm), FIELD(LayerParams, knorm),
    FIELD(LayerParams, post_attn), FIELD(LayerParams, post_mlp), FIELD(LayerParams, kpool),
    FIELD(LayerParams, vpool), FIELD(LayerParams, cos), FIELD(LayerParams, sin),
    FIELD(LayerParams, H),  FIELD(LayerParams, Hq),    FIELD(LayerParams, Hkv),
    FIELD(LayerParams, D),  FIELD(LayerParams, I),     FIELD(LayerParams, nblk),
    FIELD(LayerParams, bs), FIELD(LayerParams, window), FIELD(LayerParams, act),
    FIELD(LayerParams, eps), FIELD(LayerParams, scale), FIELD(LayerParams, softcap),
};

long bs_layout(const char *type, const char *field) {
    for (size_t i = 0; i < sizeof(LAYOUT) / sizeof(LAYOUT[0]); i++)
        if (strcmp(LAYOUT[i].type, type) == 0 && strcmp(LAYOUT[i].field, field) == 0)
            return LAYOUT[i].value;
    return -1;
}
