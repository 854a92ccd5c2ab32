"""C kernels for quantized decode on the CPU: int8 and int4 GEMVs and a fused layer.

Batch-1 decode reads every weight once per token, so it runs at the speed weights stream
from memory. torch's `_weight_int8pack_mm` reads int8 weights at ~16 GB/s here, while
bitserve's own fp32 GEMV (bitserve/llm/kernels.py) reads fp32 at ~37 GB/s: int8 through
torch is only ~1.7x faster than fp32, and the ~600 small torch ops of an unfused decode
step cost about as much again. So, like the fp32 engine, quantized models decode in C:

- `bs_qgemv`: y = x @ W.T + b for a few rows of x.
  - int8 (a scale per output row): each weight row is widened to fp32 in registers
    once per tile of up to 4 rows of x; activations stay fp32, so the result is the
    dequantized weights times x in fp32. ~31 GB/s of int8 on the 58M bench model's
    layers, 3.3x the fp32 GEMV. From 5 rows, a layer with int8 activations quantizes
    x per row as its torch._int_mm path does and runs AVX512-VNNI (64 multiply-adds an
    instruction): the same sums, faster than _int_mm to 8 rows (used there), behind at 16.
  - int4 (groups of 32/64/128, bf16 scale and zero): 4-bit codes become bf16 through a
    register table and meet x, rounded to bf16 as torch's int4pack rounds it, in
    AVX512-BF16 dot products; one row scales each group's sum, several rows first
    dequantize the codes (a per-group table) and share them. About as fast as
    `_weight_int4pack_mm_for_cpu` from 1 to 32 rows (a first version widening to fp32
    ran at half its speed); the gain is the fusion below and no second weight copy.
- `bs_q_llama_decode_layer`: bitserve/llm/kernels.py's fused Llama decode layer with
  `bs_qgemv` in place of its fp32 GEMV. It is compiled in one unit with that file's
  SOURCE and reuses its RMSNorm, RoPE and paged attention, so the steps are the same.

Built and cached the way bitserve/llm/kernels.py builds its own (gcc, -march=native,
ctypes); without a compiler, or with BITSERVE_NO_KERNELS=1, `get()` is None and the
quantized layers use torch's kernels.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import torch

from bitserve.llm import kernels as llm_kernels

Q_SOURCE = r"""
#include <stdint.h>

typedef struct {
    long kind; /* 1: int8 rows, 2: int4 groups */
    const uint8_t *q; /* int8: [N, K]; int4: [N, Kp / 2], see Int4Linear */
    const float *scale; /* int8: [N] */
    const uint16_t *s4, *z4; /* int4: bf16 [N, Kp / group], w = (q - 8) * s + z */
    const float *bias; /* [N] or NULL */
    long N, K, Kp, group;
    const int32_t *wsum; /* int8 with int8 activations: sum of each row's q; else NULL */
    long a8_rows; /* with wsum: from this many rows on, quantize x and use VNNI */
} QWeight;

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

#ifdef __AVX512F__
/* rows r < R of x (row stride ldx) against weight row n; R is a constant after inlining,
   so the 4 x R accumulators stay in registers and each weight vector is widened once. */
static inline __attribute__((always_inline)) void q8_tile(const QWeight *w, const float *x,
                                                          long ldx, long n, float *out,
                                                          const long R) {
    const int8_t *wn = (const int8_t *)w->q + n * w->K;
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

static void q8_row_plain(const QWeight *w, const float *x, long n, float *out) {
    const int8_t *wn = (const int8_t *)w->q + n * w->K;
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (long k = 0; k < w->K; k++) t += (float)wn[k] * x[k];
    *out = t;
}

/* int4: every 64 columns are 32 bytes, column j in the low nibble of byte j and column
   32 + j in its high nibble, so one 32-byte load widens to two vectors of 32 columns.
   The nibbles become bf16(q - 8) through a 16-entry table (vpermw) and meet x, rounded
   to bf16, in bf16 dot products (32 multiply-adds an instruction); each group's partial
   sum is scaled once, and the zero points act through x's fp32 sum over the group, so
   only the centred part (q - 8) * s sees x's bf16 rounding. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void q4_tile(const QWeight *w, const uint16_t *xb,
                                                          const float *xs, long n, float *out,
                                                          const long R) {
    long Kp = w->Kp, g = w->group, G = Kp / g;
    const uint8_t *qn = w->q + n * (Kp / 2);
    const uint16_t *sn = w->s4 + n * G, *zn = w->z4 + n * G;
    const __m512i lut = _mm512_set_epi16( /* q -> bf16(q - 8) */
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
        0x4000, 0x3f80, 0, (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080,
        (short)0xc0a0, (short)0xc0c0, (short)0xc0e0, (short)0xc100);
    const __m512i nib = _mm512_set1_epi16(15);
    __m512 acc[4][2], t[4];
    float zs[4];
    for (long r = 0; r < R; r++) {
        acc[r][0] = acc[r][1] = t[r] = _mm512_setzero_ps();
        zs[r] = 0.f;
    }
    long blocks_per_group = g / 64, left = blocks_per_group, gi = 0; /* g >= 64 */
    for (long c = 0; c < Kp; c += 64) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qn + c / 2)));
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, nib), lut);
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
        if (g == 32) { /* two groups per 64 columns: one scale each */
            long g0 = c / 32;
            float s0 = bf16_to_float(sn[g0]), s1 = bf16_to_float(sn[g0 + 1]);
            float z0 = bf16_to_float(zn[g0]), z1 = bf16_to_float(zn[g0 + 1]);
            __m512 sv0 = _mm512_set1_ps(s0), sv1 = _mm512_set1_ps(s1);
            for (long r = 0; r < R; r++) {
                const uint16_t *xr = xb + r * Kp + c;
                __m512 zero = _mm512_setzero_ps();
                __m512 t0 = _mm512_dpbf16_ps(zero, lo, (__m512bh)_mm512_loadu_si512(xr));
                __m512 t1 = _mm512_dpbf16_ps(zero, hi, (__m512bh)_mm512_loadu_si512(xr + 32));
                acc[r][0] = _mm512_fmadd_ps(t0, sv0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(t1, sv1, acc[r][1]);
                zs[r] += z0 * xs[r * G + g0] + z1 * xs[r * G + g0 + 1];
            }
            continue;
        }
        for (long r = 0; r < R; r++) {
            const uint16_t *xr = xb + r * Kp + c;
            t[r] = _mm512_dpbf16_ps(t[r], lo, (__m512bh)_mm512_loadu_si512(xr));
            t[r] = _mm512_dpbf16_ps(t[r], hi, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
        if (--left == 0) { /* a group ends: scale it */
            float s = bf16_to_float(sn[gi]), z = bf16_to_float(zn[gi]);
            __m512 sv = _mm512_set1_ps(s);
            for (long r = 0; r < R; r++) {
                acc[r][0] = _mm512_fmadd_ps(t[r], sv, acc[r][0]);
                t[r] = _mm512_setzero_ps();
                zs[r] += z * xs[r * G + gi];
            }
            gi++;
            left = blocks_per_group;
        }
    }
    for (long r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + zs[r];
}
/* More rows (batched decode): the codes of each 32 columns are dequantized once, through
   a per-group table of bf16((q - 8) * s + z), and every row is then two bf16 dot products
   per 64 columns: no per-row scaling, and no zero-point term. */
static inline __attribute__((always_inline)) void q4_tile_wide(const QWeight *w,
                                                               const uint16_t *xb, long n,
                                                               float *out, const long R) {
    long Kp = w->Kp, g = w->group;
    const uint8_t *qn = w->q + n * (Kp / 2);
    const uint16_t *sn = w->s4 + n * (Kp / g), *zn = w->z4 + n * (Kp / g);
    const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    const __m512i nib = _mm512_set1_epi16(15);
    __m512 acc[8];
    for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long c = 0; c < Kp; c += 64) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qn + c / 2)));
        __m512i table[2];
        for (int half = 0; half < 2; half++) {
            long gi = (c + 32 * half) / g;
            __m512 values = _mm512_fmadd_ps(centred, _mm512_set1_ps(bf16_to_float(sn[gi])),
                                            _mm512_set1_ps(bf16_to_float(zn[gi])));
            table[half] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
        }
        __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, nib), table[0]);
        __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table[1]);
        for (long r = 0; r < R; r++) {
            const uint16_t *xr = xb + r * Kp + c;
            acc[r] = _mm512_dpbf16_ps(acc[r], lo, (__m512bh)_mm512_loadu_si512(xr));
            acc[r] = _mm512_dpbf16_ps(acc[r], hi, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
    }
    for (long r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

static void q4_row_plain(const QWeight *w, const uint16_t *xb, const float *xs, long n,
                         float *out) {
    long Kp = w->Kp, g = w->group, G = Kp / g;
    const uint8_t *qn = w->q + n * (Kp / 2);
    float t = 0.f;
    for (long gi = 0; gi < G; gi++) {
        float d = 0.f;
        for (long k = gi * g; k < (gi + 1) * g; k++) {
            uint8_t b = qn[(k / 64) * 32 + k % 32];
            float q = (float)((k % 64) < 32 ? (b & 15) : (b >> 4)) - 8.f;
            d += q * bf16_to_float(xb[k]);
        }
        t += bf16_to_float(w->s4[n * G + gi]) * d + bf16_to_float(w->z4[n * G + gi]) * xs[gi];
    }
    *out = t;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    union { float f; uint32_t u; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
}

static void q4_gemv(const QWeight *w, const float *x, long ldx, long M, float *y) {
    long N = w->N, Kp = w->Kp, G = Kp / w->group;
    long tile = M == 1 ? 4 : 8; /* one row: scale after the dot; more: dequantize first */
    uint16_t *xb = (uint16_t *)calloc(M * Kp, sizeof(uint16_t));
    float *xs = (float *)calloc(M * G, sizeof(float));
    for (long m = 0; m < M; m++) {
        for (long k = 0; k < w->K; k++) {
            xb[m * Kp + k] = float_to_bf16(x[m * ldx + k]);
            if (tile == 4) xs[m * G + k / w->group] += x[m * ldx + k];
        }
    }
    for (long n = 0; n < N; n++) {
        for (long m0 = 0; m0 < M; m0 += tile) {
            long R = M - m0 < tile ? M - m0 : tile;
            const uint16_t *xm = xb + m0 * Kp;
            const float *sm = xs + m0 * G;
            float out[8];
#if defined(__AVX512F__) && defined(__AVX512BF16__)
            if (tile == 4) {
                switch (R) {
                case 1: q4_tile(w, xm, sm, n, out, 1); break;
                case 2: q4_tile(w, xm, sm, n, out, 2); break;
                case 3: q4_tile(w, xm, sm, n, out, 3); break;
                default: q4_tile(w, xm, sm, n, out, 4); break;
                }
            } else {
                switch (R) {
                case 1: q4_tile_wide(w, xm, n, out, 1); break;
                case 2: q4_tile_wide(w, xm, n, out, 2); break;
                case 3: q4_tile_wide(w, xm, n, out, 3); break;
                case 4: q4_tile_wide(w, xm, n, out, 4); break;
                case 5: q4_tile_wide(w, xm, n, out, 5); break;
                case 6: q4_tile_wide(w, xm, n, out, 6); break;
                case 7: q4_tile_wide(w, xm, n, out, 7); break;
                default: q4_tile_wide(w, xm, n, out, 8); break;
                }
            }
#else
            for (long r = 0; r < R; r++) q4_row_plain(w, xm + r * Kp, sm + r * G, n, out + r);
#endif
            float b = w->bias ? w->bias[n] : 0.f;
            for (long r = 0; r < R; r++) y[(m0 + r) * N + n] = out[r] + b;
        }
    }
    free(xb);
    free(xs);
}

/* y [M, N] = x [M, K] (row stride ldx) @ dequant(W).T + bias */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* int8 weights against int8 activations (x + 128 as unsigned bytes, the rows of a tile of
   up to 8): one VNNI instruction is 64 multiply-adds, and each weight row is loaded once
   for the tile. The +128 is taken off afterwards with the row's sum of q. */
static inline __attribute__((always_inline)) void q8a8_tile(const QWeight *w,
                                                            const uint8_t *xq, long ldq,
                                                            long n, int32_t *out,
                                                            const long R) {
    const int8_t *wn = (const int8_t *)w->q + n * w->K;
    long K = w->K;
    __m512i acc[8];
    for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
    for (long k = 0; k < K; k += 64) {
        __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i wv = _mm512_maskz_loadu_epi8(m, wn + k);
        for (long r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(xq + r * ldq + k), wv);
    }
    for (long r = 0; r < R; r++) out[r] = _mm512_reduce_add_epi32(acc[r]);
}

/* y = x @ W.T with x quantized per row (absmax / 127, as torch._int_mm's path does) */
static void q8a8_gemv(const QWeight *w, const float *x, long ldx, long M, float *y) {
    long N = w->N, K = w->K, ldq = (K + 63) / 64 * 64;
    uint8_t *xq = (uint8_t *)calloc(M * ldq, 1);
    float *xscale = (float *)malloc(sizeof(float) * M);
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float amax = 0.f;
        for (long k = 0; k < K; k++) amax = fabsf(xm[k]) > amax ? fabsf(xm[k]) : amax;
        float scale = (amax > 1e-12f ? amax : 1e-12f) / 127.f, inv = 1.f / scale;
        xscale[m] = scale;
        for (long k = 0; k < K; k++) {
            float q = nearbyintf(xm[k] * inv);
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            xq[m * ldq + k] = (uint8_t)((int)q + 128);
        }
    }
    for (long n = 0; n < N; n++) {
        for (long m0 = 0; m0 < M; m0 += 8) {
            long R = M - m0 < 8 ? M - m0 : 8;
            const uint8_t *xm = xq + m0 * ldq;
            int32_t out[8];
            switch (R) {
            case 1: q8a8_tile(w, xm, ldq, n, out, 1); break;
            case 2: q8a8_tile(w, xm, ldq, n, out, 2); break;
            case 3: q8a8_tile(w, xm, ldq, n, out, 3); break;
            case 4: q8a8_tile(w, xm, ldq, n, out, 4); break;
            case 5: q8a8_tile(w, xm, ldq, n, out, 5); break;
            case 6: q8a8_tile(w, xm, ldq, n, out, 6); break;
            case 7: q8a8_tile(w, xm, ldq, n, out, 7); break;
            default: q8a8_tile(w, xm, ldq, n, out, 8); break;
            }
            float b = w->bias ? w->bias[n] : 0.f;
            for (long r = 0; r < R; r++) {
                int32_t dot = out[r] - 128 * w->wsum[n];
                y[(m0 + r) * N + n] = (float)dot * (xscale[m0 + r] * w->scale[n]) + b;
            }
        }
    }
    free(xq);
    free(xscale);
}
#endif

void bs_qgemv(const QWeight *w, const float *x, long ldx, long M, float *y) {
    long N = w->N;
    if (w->kind == 2) {
        q4_gemv(w, x, ldx, M, y);
        return;
    }
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    if (w->wsum != NULL && M >= w->a8_rows) {
        q8a8_gemv(w, x, ldx, M, y);
        return;
    }
#endif
    for (long n = 0; n < N; n++) {
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

typedef struct {
    const float *ln1, *ln2;
    QWeight qkv, o, gu, down;
    float *kpool, *vpool;
    const float *cos, *sin; /* [max_len, D] */
    long H, Hq, Hkv, D, I, nblk, bs;
    float eps, scale;
} QLayerParams;

/* bs_llama_decode_layer (above) with quantized weights: same steps, same order. */
void bs_q_llama_decode_layer(const QLayerParams *p, float *x, long M, const long *positions,
                             const long *slots, const int *rows, const int *tables,
                             long max_blocks, const int *lens, float *scratch) {
    long H = p->H, D = p->D, Hq = p->Hq, Hkv = p->Hkv, I = p->I;
    long QKV = (Hq + 2 * Hkv) * D;
    float *h = scratch, *qkv = h + M * H, *att = qkv + M * QKV, *gu = att + M * Hq * D,
          *act = gu + M * 2 * I;
    rmsnorm(x, p->ln1, h, M, H, p->eps);
    bs_qgemv(&p->qkv, h, H, M, qkv);
    rope_and_store(qkv, M, Hq, Hkv, D, positions, p->cos, p->sin, slots, p->kpool, p->vpool,
                   p->nblk, p->bs);
    paged_decode(qkv, QKV, att, Hq * D, rows, M, Hq, Hkv, D, p->kpool, p->vpool, p->nblk,
                 p->bs, tables, max_blocks, lens, p->scale);
    bs_qgemv(&p->o, att, Hq * D, M, h);
    for (long i = 0; i < M * H; i++) x[i] = x[i] + h[i];
    rmsnorm(x, p->ln2, h, M, H, p->eps);
    bs_qgemv(&p->gu, h, H, M, gu);
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *a = act + m * I;
        for (long i = 0; i < I; i++) a[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
    }
    bs_qgemv(&p->down, act, I, M, h);
    for (long i = 0; i < M * H; i++) x[i] = x[i] + h[i];
}
"""

_kernels: QuantKernels | bool | None = False  # False: not tried yet


class QWeight(ctypes.Structure):
    """Mirror of the C `QWeight`: one int8 layer's pointers and sizes."""

    _fields_ = [
        ("kind", ctypes.c_long),
        *[(name, ctypes.c_void_p) for name in ("q", "scale", "s4", "z4", "bias")],
        *[(name, ctypes.c_long) for name in ("N", "K", "Kp", "group")],
        ("wsum", ctypes.c_void_p),
        ("a8_rows", ctypes.c_long),
    ]


class QLayerParams(ctypes.Structure):
    _fields_ = [
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        *[(name, QWeight) for name in ("qkv", "o", "gu", "down")],
        *[(name, ctypes.c_void_p) for name in ("kpool", "vpool", "cos", "sin")],
        *[(name, ctypes.c_long) for name in ("H", "Hq", "Hkv", "D", "I", "nblk", "bs")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def source() -> str:
    return llm_kernels.SOURCE + Q_SOURCE


def qweight(layer, bias: bool = True) -> QWeight:
    """The C view of an Int8Linear or Int4Linear (pointers into its buffers, which must
    stay alive as long as the view)."""
    from bitserve.quant.linear import Int4Linear

    w = QWeight(N=layer.out_features, K=layer.in_features, q=layer.qweight.data_ptr())
    w.bias = llm_kernels.ptr(layer.bias) if bias else None
    if isinstance(layer, Int4Linear):
        w.kind, w.s4, w.z4 = 2, layer.scales.data_ptr(), layer.zeros.data_ptr()
        w.Kp, w.group = layer.padded_in, layer.group_size
    else:
        w.kind, w.scale = 1, layer.scales.data_ptr()
        if getattr(layer, "row_sums", None) is not None:  # int8 activations above a8_rows
            w.wsum, w.a8_rows = layer.row_sums.data_ptr(), layer.a8_rows
    return w


class QuantKernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_long
        self._gemv = lib.bs_qgemv
        self._gemv.argtypes = [ctypes.POINTER(QWeight), p, i, i, p]
        self._gemv.restype = None
        self._layer = lib.bs_q_llama_decode_layer
        self._layer.argtypes = [ctypes.POINTER(QLayerParams), p, i, p, p, p, p, i, p, p]
        self._layer.restype = None

    def linear(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 with unit inner stride -> [M, N] fp32."""
        y = torch.empty(x.shape[0], w.N, dtype=torch.float32)
        self._gemv(ctypes.byref(w), x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr())
        return y

    def decode_layer(self, params: QLayerParams, x, positions, slots, decode, scratch) -> None:
        llm_kernels.call_decode_layer(self._layer, params, x, positions, slots, decode, scratch)


def get() -> QuantKernels | None:
    global _kernels
    if _kernels is False:
        _kernels = None
        if cc := llm_kernels.compiler():
            try:  # the engine's kernels and these, in one library
                _kernels = QuantKernels(llm_kernels.build(cc, source(), "quant"))
            except (OSError, subprocess.SubprocessError):
                _kernels = None
    return _kernels


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded kernels (tests): `enabled=False` forces the torch paths."""
    global _kernels
    _kernels = None if enabled is False else False
