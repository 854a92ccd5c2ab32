/* One-token attention for many sequences in one call, reading K/V in place from the
   head-major block pool [kv_heads, num_blocks, block_size, head_dim] through the block
   tables: no gather copy and no per-sequence Python. */
#include "internal.h"

#ifdef __AVX512F__
/* out[j] = sum of the 16 lanes of v[j], for 16 vectors at once: a transpose-and-add
   tree of 15 shuffles and adds in all, instead of 16 separate horizontal reductions. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 p[8], q[4], r[2];
    for (int i = 0; i < 8; i++) /* lanes: [a0+a2, b0+b2, a1+a3, b1+b3] per 128 bits */
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* [a, b, c, d] partial sums per 128 bits */
        __m512d x = _mm512_castps_pd(p[2 * i]), y = _mm512_castps_pd(p[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes pairwise: 8 keys, 2 partials each */
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88),
                         _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
}

/* Scores of one query head against a block of 16 keys (D = 32 or 64), n of them real. */
static inline void block_scores(const float *qh, const float *kb, long n, long D, float scale,
                                float *out) {
    __m512 prod[16];
    __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16);
    for (long j = 0; j < 16; j++) {
        if (j >= n) {
            prod[j] = _mm512_setzero_ps();
            continue;
        }
        const float *kj = kb + j * D;
        __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kj));
        a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kj + 16), a);
        if (D == 64) {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 32), _mm512_loadu_ps(kj + 32), a);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 48), _mm512_loadu_ps(kj + 48), a);
        }
        prod[j] = a;
    }
    __m512 s = _mm512_mul_ps(reduce16(prod), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), s);
}
#endif

/* Block `blk` of a KV head's keys and values (n floats each) into L2. */
static inline void prefetch_block(const float *k, const float *v, long blk, long n) {
    for (long c = 0; c < n; c += 16) {
        __builtin_prefetch(k + blk * n + c, 0, 2);
        __builtin_prefetch(v + blk * n + c, 0, 2);
    }
}

typedef struct {
    const float *q;
    long ldq;
    float *out;
    long ldo;
    const int *rows;
    long B, Hq, Hkv, D;
    const float *kpool, *vpool;
    long nblk, bs;
    const int *tables;
    long max_blocks;
    const int *lens;
    float scale;
    long window;
    float softcap;
    long split; /* parts of each KV head's group of query heads (1 but for few items) */
    long per;   /* items a task */
} Attend;

/* Task t of bs_attend: items [t * per, (t + 1) * per) of the B * Hkv * split (sequence, KV
   head, part of its query heads) triples, each independent of the others. The query heads
   that share a KV head (GQA) read each block of its keys and values once, while it is in
   L1, one head after another: per head the arithmetic and its order are those of a head
   alone (the same bits), the pool's K/V is streamed once, not once per query head. */
static void attend_task(void *job, long t) {
    const Attend *J = job;
    const float *q = J->q, *kpool = J->kpool, *vpool = J->vpool;
    float *out = J->out;
    const int *rows = J->rows, *tables = J->tables, *lens = J->lens;
    long ldq = J->ldq, ldo = J->ldo, B = J->B, Hkv = J->Hkv, D = J->D, bs = J->bs;
    long nblk = J->nblk, max_blocks = J->max_blocks, window = J->window, split = J->split;
    float scale = J->scale, softcap = J->softcap;
    long group = J->Hq / Hkv, gper = (group + split - 1) / split, max_len = max_blocks * bs;
    long items = B * Hkv * split;
    long first = t * J->per, last = first + J->per < items ? first + J->per : items;
    long stride = max_len > 0 ? max_len : 1; /* one head's scores */
    float *scores = (float *)malloc(sizeof(float) * stride * gper);
    float *acc = (float *)malloc(sizeof(float) * D * gper);
    float *inv = (float *)malloc(sizeof(float) * gper);
    for (long item = first; item < last; item++) {
        long i = item / (Hkv * split), kvh = item / split % Hkv, part = item % split;
        long h0 = kvh * group + part * gper;
        long nh = (kvh + 1) * group - h0 < gper ? (kvh + 1) * group - h0 : gper;
        if (nh <= 0) continue;
        const int *table = tables + i * max_blocks;
        long len = lens[i], nb = (len + bs - 1) / bs;
        long lo = window > 0 && len > window ? len - window : 0, b0 = lo / bs;
        const float *qrow = q + (long)rows[i] * ldq;
        float *orow = out + (long)rows[i] * ldo;
        const float *kh = kpool + kvh * nblk * bs * D;
        const float *vh = vpool + kvh * nblk * bs * D;
        /* the next item's keys and values are other pages (the hardware prefetches none
           of them): they are asked for into L2 a block per block of this item's keys */
        long next = item + 1 < items ? item + 1 : item, ni = next / (Hkv * split);
        long next_kvh = next / split % Hkv, next_nb = next == item ? 0 : (lens[ni] + bs - 1) / bs;
        const int *next_table = tables + ni * max_blocks;
        const float *next_k = kpool + next_kvh * nblk * bs * D;
        const float *next_v = vpool + next_kvh * nblk * bs * D;
        /* scores: block by block (each block's keys are bs * D contiguous floats) */
#ifdef __AVX512F__
        if (bs == 16 && (D == 32 || D == 64)) { /* 16 keys at a time, one reduction */
            for (long b = b0; b < nb; b++) {
                long n = len - b * bs < bs ? len - b * bs : bs;
                const float *kb = kh + (long)table[b] * bs * D;
                if (b < next_nb) prefetch_block(next_k, next_v, next_table[b], bs * D);
                for (long g = 0; g < nh; g++)
                    block_scores(qrow + (h0 + g) * D, kb, n, D, scale,
                                 scores + g * stride + b * bs);
            }
        } else
#endif
        for (long g = 0; g < nh; g++) {
            const float *qh = qrow + (h0 + g) * D;
            for (long b = b0; b < nb; b++) {
                const float *kb = kh + (long)table[b] * bs * D;
                long n = len - b * bs < bs ? len - b * bs : bs;
                float *sb = scores + g * stride + b * bs;
                /* the next block is another page: prefetch it while this one is read */
                const float *kn = b + 1 < nb ? kh + (long)table[b + 1] * bs * D : kb;
                for (long j = 0; j < n; j++) {
                    for (long c = 0; c < D; c += 16) __builtin_prefetch(kn + j * D + c);
                    sb[j] = dot(qh, kb + j * D, D) * scale;
                }
            }
        }
        for (long b = nb; b < next_nb; b++) prefetch_block(next_k, next_v, next_table[b], bs * D);
        for (long g = 0; g < nh; g++) {
            float *s = scores + g * stride, mx = -3.0e38f;
            if (softcap > 0.f) {
                float inv_cap = 1.f / softcap;
#pragma omp simd
                for (long t = lo; t < len; t++) s[t] = tanhf(s[t] * inv_cap) * softcap;
            }
            for (long t = lo; t < len; t++) mx = s[t] > mx ? s[t] : mx;
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (long t = lo; t < len; t++) {
                float e = expf(s[t] - mx);
                s[t] = e;
                total += e;
            }
            inv[g] = 1.f / total;
        }
#ifdef __AVX512F__
        if (D == 64) { /* the common head size: a head's accumulator in registers a block */
            memset(acc, 0, sizeof(float) * D * nh);
            for (long b = b0; b < nb; b++) {
                const float *vb = vh + (long)table[b] * bs * D;
                long n = len - b * bs < bs ? len - b * bs : bs;
                const float *vn = b + 1 < nb ? vh + (long)table[b + 1] * bs * D : vb;
                for (long g = 0; g < nh; g++) {
                    const float *sb = scores + g * stride + b * bs;
                    float *ag = acc + g * 64;
                    __m512 a0 = _mm512_loadu_ps(ag), a1 = _mm512_loadu_ps(ag + 16),
                           a2 = _mm512_loadu_ps(ag + 32), a3 = _mm512_loadu_ps(ag + 48);
                    for (long j = b == b0 ? lo - b * bs : 0; j < n; j++) {
                        __m512 p = _mm512_set1_ps(sb[j]);
                        const float *vt = vb + j * 64;
                        if (g == 0)
                            for (long c = 0; c < 64; c += 16) __builtin_prefetch(vn + j * 64 + c);
                        a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt), a0);
                        a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16), a1);
                        a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 32), a2);
                        a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 48), a3);
                    }
                    _mm512_storeu_ps(ag, a0);
                    _mm512_storeu_ps(ag + 16, a1);
                    _mm512_storeu_ps(ag + 32, a2);
                    _mm512_storeu_ps(ag + 48, a3);
                }
            }
            for (long g = 0; g < nh; g++) {
                __m512 vi = _mm512_set1_ps(inv[g]);
                const float *ag = acc + g * 64;
                float *oh = orow + (h0 + g) * 64;
                for (long c = 0; c < 64; c += 16)
                    _mm512_storeu_ps(oh + c, _mm512_mul_ps(_mm512_loadu_ps(ag + c), vi));
            }
            continue;
        }
#endif
        for (long g = 0; g < nh; g++) {
            const float *s = scores + g * stride;
            float *a = acc;
            memset(a, 0, sizeof(float) * D);
            for (long b = b0; b < nb; b++) {
                const float *vb = vh + (long)table[b] * bs * D;
                long n = len - b * bs < bs ? len - b * bs : bs;
                for (long j = b == b0 ? lo - b * bs : 0; j < n; j++) {
                    const float *vt = vb + j * D;
                    float p = s[b * bs + j];
#pragma omp simd
                    for (long d = 0; d < D; d++) a[d] += p * vt[d];
                }
            }
            float *oh = orow + (h0 + g) * D;
            for (long d = 0; d < D; d++) oh[d] = a[d] * inv[g];
        }
    }
    free(inv);
    free(acc);
    free(scores);
}

/* Decode attention over a paged, head-major pool, for sequence i in row rows[i].
   q: row stride ldq, heads of D; out: row stride ldo; kpool, vpool: [Hkv, nblk, bs, D];
   tables: [B, max_blocks] int32; lens[i]: context length of sequence i (including its
   new token, already written to the pool). window > 0: only the last `window` keys
   (sliding-window layers; blocks before them are never read, they may be freed);
   softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2). The pool's
   threads share the (sequence, KV head) pairs, a few tasks per thread; a KV head's query
   heads split into parts only where there are too few pairs for the tasks (batch 1). */
void bs_attend(const float *q, long ldq, float *out, long ldo, const int *rows, long B, long Hq,
               long Hkv, long D, const float *kpool, const float *vpool, long nblk, long bs,
               const int *tables, long max_blocks, const int *lens, float scale, long window,
               float softcap) {
    long pairs = B * Hkv, tasks = 4 * bs_get_threads(), group = Hq / Hkv, split = 1;
    if (pairs > 0 && pairs < tasks) {
        split = (tasks + pairs - 1) / pairs;
        if (split > group) split = group;
    }
    long items = pairs * split;
    Attend job = {q,     ldq,   out,        ldo,  rows,  B,      Hq,    Hkv,     D,
                  kpool, vpool, nblk,       bs,   tables, max_blocks, lens, scale, window,
                  softcap, split, (items + tasks - 1) / tasks};
    if (job.per < 1) job.per = 1;
    bs_parallel(attend_task, &job, (items + job.per - 1) / job.per);
}

void bs_paged_decode(const float *q, float *out, const int *rows, long B, long Hq, long Hkv,
                     long D, const float *kpool, const float *vpool, long nblk, long bs,
                     const int *tables, long max_blocks, const int *lens, float scale,
                     long window, float softcap) {
    bs_attend(q, Hq * D, out, Hq * D, rows, B, Hq, Hkv, D, kpool, vpool, nblk, bs, tables,
              max_blocks, lens, scale, window, softcap);
}
