"""Two small C kernels for CPU decode, compiled once with the system's gcc and cached.

- `linear_small`: `y = x @ W.T (+ b)` for up to 64 rows of `x` (decode). MKL's fp32
  GEMV reads weights at ~15 GB/s on one core here, about half of what a plain sum reads
  (research/cpu-facts.md §1); this loop streams each weight row once, for all rows of
  `x`, at close to the read bandwidth. From 4 rows up (batched decode) a 4x4 register
  tile keeps the FMA units busy instead: ~1.4x MKL's sgemm at 16-64 rows.
- `paged_decode`: one-token attention for many sequences in one call, reading K/V in
  place from the head-major block pool `[kv_heads, num_blocks, block_size, head_dim]`
  through the block tables, so there is no gather copy and no per-sequence Python.

The source is plain C (portable loops with `omp simd`; `-march=native` picks the
vector width). It is compiled with `-ffast-math` but linked without it, so the
shared object does not switch the whole process to flush-to-zero. The library lands
in `$BITSERVE_KERNEL_CACHE` (default `~/.cache/bitserve/kernels`) under a hash of the
source, flags and CPU, and is loaded with ctypes: no ninja, no Python headers.
Without a compiler, or with `BITSERVE_NO_KERNELS=1`, `get()` returns None and every
caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

SOURCE = r"""
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

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

void bs_linear_small(const float *x, long ldx, long M, long K, const float *w, long N,
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

/* Decode attention over a paged, head-major pool, for sequence i in row rows[i].
   q: row stride ldq, heads of D; out: row stride ldo; kpool, vpool: [Hkv, nblk, bs, D];
   tables: [B, max_blocks] int32; lens[i]: context length of sequence i (including its
   new token, already written to the pool). window > 0: only the last `window` keys
   (sliding-window layers; blocks before them are never read, they may be freed);
   softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2). */
static void paged_decode(const float *q, long ldq, float *out, long ldo, const int *rows,
                         long B, long Hq, long Hkv, long D, const float *kpool,
                         const float *vpool, long nblk, long bs, const int *tables,
                         long max_blocks, const int *lens, float scale, long window,
                         float softcap) {
    long group = Hq / Hkv, max_len = max_blocks * bs;
    float *scores = (float *)malloc(sizeof(float) * (max_len > 0 ? max_len : 1));
    float *acc = (float *)malloc(sizeof(float) * D);
    for (long i = 0; i < B; i++) {
        const int *table = tables + i * max_blocks;
        long len = lens[i], nb = (len + bs - 1) / bs;
        long lo = window > 0 && len > window ? len - window : 0, b0 = lo / bs;
        for (long h = 0; h < Hq; h++) {
            long kvh = h / group;
            const float *qh = q + (long)rows[i] * ldq + h * D;
            const float *kh = kpool + kvh * nblk * bs * D;
            const float *vh = vpool + kvh * nblk * bs * D;
            /* scores: block by block (each block's keys are bs * D contiguous floats) */
            float mx = -3.0e38f;
#ifdef __AVX512F__
            if (bs == 16 && (D == 32 || D == 64)) { /* 16 keys at a time, one reduction */
                for (long b = b0; b < nb; b++) {
                    long n = len - b * bs < bs ? len - b * bs : bs;
                    block_scores(qh, kh + (long)table[b] * bs * D, n, D, scale, scores + b * bs);
                }
            } else
#endif
            for (long b = b0; b < nb; b++) {
                const float *kb = kh + (long)table[b] * bs * D;
                long n = len - b * bs < bs ? len - b * bs : bs;
                float *sb = scores + b * bs;
                /* the next block is another page: prefetch it while this one is read */
                const float *kn = b + 1 < nb ? kh + (long)table[b + 1] * bs * D : kb;
                for (long j = 0; j < n; j++) {
                    for (long c = 0; c < D; c += 16) __builtin_prefetch(kn + j * D + c);
                    sb[j] = dot(qh, kb + j * D, D) * scale;
                }
            }
            if (softcap > 0.f) {
                float inv_cap = 1.f / softcap;
#pragma omp simd
                for (long t = lo; t < len; t++) scores[t] = tanhf(scores[t] * inv_cap) * softcap;
            }
            for (long t = lo; t < len; t++) mx = scores[t] > mx ? scores[t] : mx;
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (long t = lo; t < len; t++) {
                float e = expf(scores[t] - mx);
                scores[t] = e;
                total += e;
            }
            float inv = 1.f / total;
            float *oh = out + (long)rows[i] * ldo + h * D;
#ifdef __AVX512F__
            if (D == 64) { /* the common head size: the accumulator stays in registers */
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (long b = b0; b < nb; b++) {
                    const float *vb = vh + (long)table[b] * bs * D;
                    long n = len - b * bs < bs ? len - b * bs : bs;
                    const float *sb = scores + b * bs;
                    const float *vn = b + 1 < nb ? vh + (long)table[b + 1] * bs * D : vb;
                    for (long j = b == b0 ? lo - b * bs : 0; j < n; j++) {
                        __m512 p = _mm512_set1_ps(sb[j]);
                        const float *vt = vb + j * 64;
                        for (long c = 0; c < 64; c += 16) __builtin_prefetch(vn + j * 64 + c);
                        a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt), a0);
                        a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16), a1);
                        a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 32), a2);
                        a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 48), a3);
                    }
                }
                __m512 vi = _mm512_set1_ps(inv);
                _mm512_storeu_ps(oh, _mm512_mul_ps(a0, vi));
                _mm512_storeu_ps(oh + 16, _mm512_mul_ps(a1, vi));
                _mm512_storeu_ps(oh + 32, _mm512_mul_ps(a2, vi));
                _mm512_storeu_ps(oh + 48, _mm512_mul_ps(a3, vi));
                continue;
            }
#endif
            memset(acc, 0, sizeof(float) * D);
            for (long b = b0; b < nb; b++) {
                const float *vb = vh + (long)table[b] * bs * D;
                long n = len - b * bs < bs ? len - b * bs : bs;
                for (long j = b == b0 ? lo - b * bs : 0; j < n; j++) {
                    const float *vt = vb + j * D;
                    float p = scores[b * bs + j];
#pragma omp simd
                    for (long d = 0; d < D; d++) acc[d] += p * vt[d];
                }
            }
            for (long d = 0; d < D; d++) oh[d] = acc[d] * inv;
        }
    }
    free(acc);
    free(scores);
}

void bs_paged_decode(const float *q, float *out, const int *rows, long B, long Hq, long Hkv,
                     long D, const float *kpool, const float *vpool, long nblk, long bs,
                     const int *tables, long max_blocks, const int *lens, float scale,
                     long window, float softcap) {
    paged_decode(q, Hq * D, out, Hq * D, rows, B, Hq, Hkv, D, kpool, vpool, nblk, bs, tables,
                 max_blocks, lens, scale, window, softcap);
}

/* One Llama decoder layer for M decode rows, in place on the residual stream x [M, H]:
   the same arithmetic, in the same order, as the torch path (RMSNorm, fused qkv, RoPE
   from the cos/sin tables, K/V into the pool, paged attention, o_proj, RMSNorm, fused
   gate/up, SiLU * up, down), so a decode step is 8 calls instead of ~600 torch ops.
   qnorm, knorm (Qwen3, Gemma 3): an RMSNorm over each q and k head before RoPE, or NULL;
   post_attn, post_mlp (Gemma's sandwich norms): an RMSNorm of the attention and MLP
   outputs before they are added, or NULL; act: 0 SiLU (SwiGLU), 1 tanh-GELU (GeGLU);
   window, softcap: as paged_decode's (0: none). Norm weights are the multipliers
   (Gemma's 1 + w computed by the caller). */
typedef struct {
    const float *ln1, *wqkv, *bqkv, *wo, *bo, *ln2, *wgu, *wdown;
    float *kpool, *vpool;
    const float *cos, *sin; /* [max_len, D] */
    const float *qnorm, *knorm, *post_attn, *post_mlp;
    long H, Hq, Hkv, D, I, nblk, bs, window, act;
    float eps, scale, softcap;
} LayerParams;

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
static void rope_and_store(float *qkv, long M, long Hq, long Hkv, long D, const long *positions,
                           const float *cos, const float *sin, const long *slots, float *kpool,
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

void bs_llama_decode_layer(const LayerParams *p, float *x, long M, const long *positions,
                           const long *slots, const int *rows, const int *tables,
                           long max_blocks, const int *lens, float *scratch) {
    long H = p->H, D = p->D, Hq = p->Hq, Hkv = p->Hkv, I = p->I;
    long QKV = (Hq + 2 * Hkv) * D;
    float *h = scratch, *qkv = h + M * H, *att = qkv + M * QKV, *gu = att + M * Hq * D,
          *act = gu + M * 2 * I;
    rmsnorm(x, p->ln1, h, M, H, p->eps);
    bs_linear_small(h, H, M, H, p->wqkv, QKV, p->bqkv, qkv);
    if (p->qnorm)
        for (long m = 0; m < M; m++) {
            float *row = qkv + m * QKV;
            for (long hd = 0; hd < Hq; hd++)
                rmsnorm(row + hd * D, p->qnorm, row + hd * D, 1, D, p->eps);
            for (long hd = Hq; hd < Hq + Hkv; hd++)
                rmsnorm(row + hd * D, p->knorm, row + hd * D, 1, D, p->eps);
        }
    rope_and_store(qkv, M, Hq, Hkv, D, positions, p->cos, p->sin, slots, p->kpool, p->vpool,
                   p->nblk, p->bs);
    paged_decode(qkv, QKV, att, Hq * D, rows, M, Hq, Hkv, D, p->kpool, p->vpool, p->nblk,
                 p->bs, tables, max_blocks, lens, p->scale, p->window, p->softcap);
    bs_linear_small(att, Hq * D, M, Hq * D, p->wo, H, p->bo, h);
    if (p->post_attn) rmsnorm(h, p->post_attn, h, M, H, p->eps);
    for (long i = 0; i < M * H; i++) x[i] = x[i] + h[i];
    rmsnorm(x, p->ln2, h, M, H, p->eps);
    bs_linear_small(h, H, M, H, p->wgu, 2 * I, NULL, gu);
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *a = act + m * I;
        if (p->act == 1) /* tanh-GELU, torch's approximate="tanh" */
            for (long i = 0; i < I; i++) {
                float v = g[i], inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
                a[i] = (0.5f * v * (1.f + tanhf(inner))) * u[i];
            }
        else
            for (long i = 0; i < I; i++) a[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
    }
    bs_linear_small(act, I, M, I, p->wdown, H, NULL, h);
    if (p->post_mlp) rmsnorm(h, p->post_mlp, h, M, H, p->eps);
    for (long i = 0; i < M * H; i++) x[i] = x[i] + h[i];
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

void bs_rope_rows(float *x, long T, long ld, long H, long D, const long *positions,
                  const float *cos, const float *sin) {
    for (long t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (long h = 0; h < H; h++) rope(x + t * ld + h * D, c, s, D);
    }
}
"""

COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fPIC"]
FAST_MATH = ["-ffast-math"]  # compile step only: vectorised expf and reductions


def cpu_signature() -> str:
    """The CPU model and flags: a cached -march=native build must not move between CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("BITSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bitserve" / "kernels"


def compiler() -> str | None:
    """The C compiler to build with; None without one or with BITSERVE_NO_KERNELS=1."""
    if os.environ.get("BITSERVE_NO_KERNELS") == "1":
        return None
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(compiler: str, source: str = SOURCE, name: str = "llm") -> Path:
    """Compile `source` into a cached shared object (atomic rename: safe across
    processes), keyed by the source, the flags, the compiler and the CPU."""
    key = hashlib.sha256(
        "\0".join([source, *COMPILE_FLAGS, *FAST_MATH, compiler, cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"bitserve_{name}_{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, obj, lib = Path(tmp) / "k.c", Path(tmp) / "k.o", Path(tmp) / "k.so"
        src.write_text(source)
        run = dict(check=True, capture_output=True, timeout=120)
        subprocess.run(
            [compiler, *COMPILE_FLAGS, *FAST_MATH, "-c", str(src), "-o", str(obj)], **run
        )
        link = [compiler, "-shared", str(obj), "-o", str(lib)]
        try:  # the vectorised expf lives in libmvec (glibc); plain libm otherwise
            subprocess.run([*link, "-lmvec", "-lm"], **run)
        except subprocess.CalledProcessError:
            subprocess.run([*link, "-lm"], **run)
        os.replace(lib, target)
    return target


class LayerParams(ctypes.Structure):
    """Mirror of the C `LayerParams`: a layer's weights and pools, built once per layer."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("ln1", "wqkv", "bqkv", "wo", "bo", "ln2")],
        *[(name, ctypes.c_void_p) for name in ("wgu", "wdown", "kpool", "vpool", "cos", "sin")],
        *[(name, ctypes.c_void_p) for name in ("qnorm", "knorm", "post_attn", "post_mlp")],
        *[
            (name, ctypes.c_long)
            for name in ("H", "Hq", "Hkv", "D", "I", "nblk", "bs", "window", "act")
        ],
        *[(name, ctypes.c_float) for name in ("eps", "scale", "softcap")],
    ]


def bind(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    """A C function of `lib` that returns nothing, with its argument types set."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), None
    return fn


class Kernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        self._linear = bind(lib, "bs_linear_small", p, i, i, i, p, i, p, p)
        self._decode = bind(
            lib, "bs_paged_decode", p, p, p, i, i, i, i, p, p, i, i, p, i, p, f, i, f
        )
        layer = ctypes.POINTER(LayerParams)
        self._layer = bind(lib, "bs_llama_decode_layer", layer, p, i, p, p, p, p, i, p, p)
        self._silu_mul = bind(lib, "bs_silu_mul", p, i, i, p)
        self._rope = bind(lib, "bs_rope_rows", p, i, i, i, i, p, p, p)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] contiguous fp32 (gate | up) -> silu(gate) * up, [M, I]."""
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=torch.float32)
        self._silu_mul(gate_up.data_ptr(), m, two_i // 2, out.data_ptr())
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos, sin) -> None:
        """In place on x [T, H, D] fp32 (heads contiguous in a row, any row stride);
        positions int64 [T] contiguous; cos, sin [max_len, D] contiguous fp32."""
        t, h, d = x.shape
        args = (x.data_ptr(), t, x.stride(0), h, d, positions.data_ptr())
        self._rope(*args, cos.data_ptr(), sin.data_ptr())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """x [M, K] fp32 with unit inner stride; weight [N, K] contiguous fp32."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        self._linear(
            x.data_ptr(),
            x.stride(0),
            m,
            k,
            weight.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
        )
        return y

    def paged_decode(
        self, q, out, rows, k_pool, v_pool, tables, lens, scale: float, window=0, softcap=0.0
    ) -> None:
        """q, out: [T, Hq, D] contiguous fp32; rows, lens: int32 [B]; tables: int32 [B, W];
        window: attend to the last `window` keys only (0: all); softcap: Gemma 2's."""
        hkv, nblk, bs, d = k_pool.shape
        self._decode(
            q.data_ptr(),
            out.data_ptr(),
            rows.data_ptr(),
            rows.shape[0],
            q.shape[1],
            hkv,
            d,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            nblk,
            bs,
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            scale,
            window,
            softcap,
        )

    def llama_decode_layer(self, params: LayerParams, x, positions, slots, decode, scratch):
        """One decoder layer, in place on x [M, H] (all rows decodes; see the C source).

        positions, slots: int64 [M]; decode: the step's `DecodeBatch`; scratch: fp32 with
        at least M * (2H + 2 Hq D + 2 Hkv D + 3 I) elements.
        """
        call_decode_layer(self._layer, params, x, positions, slots, decode, scratch)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_shape(layer: Any) -> dict[str, Any]:
    """The sizes a C decoder layer reads from its params (fp32 and quantized alike)."""
    attn, k_pool = layer.self_attn, layer.self_attn.kv_cache[0]
    return dict(
        window=attn.window or 0,
        softcap=attn.softcap or 0.0,
        H=layer.input_layernorm.weight.shape[0],
        Hq=attn.num_heads,
        Hkv=attn.num_kv_heads,
        D=attn.head_dim,
        I=layer.mlp.intermediate,
        nblk=k_pool.shape[1],
        bs=k_pool.shape[2],
        eps=layer.input_layernorm.eps,
        scale=attn.scale,
    )


def call_decode_layer(fn, params, x, positions, slots, decode, scratch) -> None:
    """Call a C decoder layer (this file's or the quantized one) with a step's tensors."""
    tables = decode.block_tables
    fn(
        ctypes.byref(params),
        x.data_ptr(),
        x.shape[0],
        positions.data_ptr(),
        slots.data_ptr(),
        decode.rows.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        decode.context_lens.data_ptr(),
        scratch.data_ptr(),
    )


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.zeros(shape)` backed by transparent huge pages where Linux allows it.

    The KV pool is read in 4 KiB pieces (a block of one head) in block-table order; on
    4 KiB pages every piece is a TLB miss and a prefetcher restart, which halves the
    decode-attention read rate. The tensor is a view at a 2 MiB-aligned offset of a
    slightly larger buffer, advised before its pages are first touched.
    """
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if numel * itemsize < HUGE_PAGE or platform.system() != "Linux":
        return torch.zeros(shape, dtype=dtype)
    buf = torch.empty(numel + HUGE_PAGE // itemsize, dtype=dtype)
    offset = (-buf.data_ptr()) % HUGE_PAGE // itemsize
    start = buf.data_ptr() + offset * itemsize
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(numel * itemsize), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return buf[offset : offset + numel].view(shape).zero_()


class Library:
    """A C library built on first use and kept for the process; None where it cannot be
    (no compiler, a failed build, or BITSERVE_NO_KERNELS=1)."""

    def __init__(self, wrapper: Any, source: Any, name: str):
        self.wrapper, self.source, self.name = wrapper, source, name  # source: () -> str
        self.loaded: Any = False  # False: not tried yet

    def get(self) -> Any:
        if self.loaded is False:
            self.loaded = None
            if cc := compiler():
                try:
                    self.loaded = self.wrapper(build(cc, self.source(), self.name))
                except (OSError, subprocess.SubprocessError):
                    self.loaded = None
        return self.loaded

    def reset(self, enabled: bool | None = None) -> None:
        """Forget the loaded library (tests): `enabled=False` forces the torch fallback."""
        self.loaded = None if enabled is False else False


_library = Library(Kernels, lambda: SOURCE, "llm")


def get() -> Kernels | None:
    """The compiled kernels, or None (no compiler, build failed, or disabled)."""
    return _library.get()


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded kernels (tests): `enabled=False` forces the torch fallback."""
    _library.reset(enabled)
