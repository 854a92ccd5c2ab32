"""Two small C kernels for CPU decode, compiled once with the system's gcc and cached.

- `linear_small`: `y = x @ W.T (+ b)` for a few rows of `x` (decode). MKL's fp32 GEMV
  reads weights at ~15 GB/s on one core here, about half of what a plain sum reads
  (research/cpu-facts.md §1); this loop streams each weight row once, for all rows of
  `x`, at close to the read bandwidth.
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

import torch

SOURCE = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* y[m, n] = sum_k x[m, k] * w[n, k] + b[n]; x [M, K] (row stride ldx), w [N, K]
   contiguous, y [M, N] contiguous. Four weight rows at a time: each is read from
   memory once and reused from L1 for every row of x. */
void bs_linear_small(const float *x, long ldx, long M, long K, const float *w, long N,
                     const float *b, float *y) {
    long n = 0;
    for (; n + 4 <= N; n += 4) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (long m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (long k = 0; k < K; k++) {
                float xv = xm[k];
                s0 += w0[k] * xv;
                s1 += w1[k] * xv;
                s2 += w2[k] * xv;
                s3 += w3[k] * xv;
            }
            float *ym = y + m * N + n;
            if (b) {
                s0 += b[n]; s1 += b[n + 1]; s2 += b[n + 2]; s3 += b[n + 3];
            }
            ym[0] = s0; ym[1] = s1; ym[2] = s2; ym[3] = s3;
        }
    }
    for (; n < N; n++) {
        const float *w0 = w + n * K;
        for (long m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
            for (long k = 0; k < K; k++) s0 += w0[k] * xm[k];
            y[m * N + n] = s0 + (b ? b[n] : 0.f);
        }
    }
}

/* Decode attention over a paged, head-major pool.
   q, out: [T, Hq, D] contiguous; rows[i]: the row of sequence i in q/out;
   kpool, vpool: [Hkv, nblk, bs, D]; tables: [B, max_blocks] int32; lens[i]: context
   length of sequence i (including its new token, already written to the pool). */
void bs_paged_decode(const float *q, float *out, const int *rows, long B, long Hq, long Hkv,
                     long D, const float *kpool, const float *vpool, long nblk, long bs,
                     const int *tables, long max_blocks, const int *lens, float scale) {
    long group = Hq / Hkv, max_len = max_blocks * bs;
    float *scores = (float *)malloc(sizeof(float) * (max_len > 0 ? max_len : 1));
    float *acc = (float *)malloc(sizeof(float) * D);
    for (long i = 0; i < B; i++) {
        const int *table = tables + i * max_blocks;
        long len = lens[i];
        for (long h = 0; h < Hq; h++) {
            long kvh = h / group;
            const float *qh = q + ((long)rows[i] * Hq + h) * D;
            const float *kh = kpool + kvh * nblk * bs * D;
            const float *vh = vpool + kvh * nblk * bs * D;
            float mx = 0.f;
            for (long t = 0; t < len; t++) {
                const float *kt = kh + ((long)table[t / bs] * bs + t % bs) * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (long d = 0; d < D; d++) s += qh[d] * kt[d];
                s *= scale;
                scores[t] = s;
                mx = (t == 0 || s > mx) ? s : mx;
            }
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (long t = 0; t < len; t++) {
                float e = expf(scores[t] - mx);
                scores[t] = e;
                total += e;
            }
            memset(acc, 0, sizeof(float) * D);
            for (long t = 0; t < len; t++) {
                const float *vt = vh + ((long)table[t / bs] * bs + t % bs) * D;
                float p = scores[t];
#pragma omp simd
                for (long d = 0; d < D; d++) acc[d] += p * vt[d];
            }
            float inv = 1.f / total;
            float *oh = out + ((long)rows[i] * Hq + h) * D;
            for (long d = 0; d < D; d++) oh[d] = acc[d] * inv;
        }
    }
    free(acc);
    free(scores);
}
"""

COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fPIC"]
FAST_MATH = ["-ffast-math"]  # compile step only: vectorised expf and reductions

_kernels: Kernels | None | bool = False  # False: not tried yet


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


def build(compiler: str) -> Path:
    """Compile SOURCE into a cached shared object (atomic rename: safe across processes)."""
    key = hashlib.sha256(
        "\0".join([SOURCE, *COMPILE_FLAGS, *FAST_MATH, compiler, cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"bitserve_llm_{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, obj, lib = Path(tmp) / "k.c", Path(tmp) / "k.o", Path(tmp) / "k.so"
        src.write_text(SOURCE)
        run = dict(check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *COMPILE_FLAGS, *FAST_MATH, "-c", str(src), "-o", str(obj)], **run)
        subprocess.run([compiler, "-shared", str(obj), "-o", str(lib), "-lm"], **run)
        os.replace(lib, target)
    return target


class Kernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        self._linear = lib.bs_linear_small
        self._linear.argtypes = [p, i, i, i, p, i, p, p]
        self._linear.restype = None
        self._decode = lib.bs_paged_decode
        self._decode.argtypes = [p, p, p, i, i, i, i, p, p, i, i, p, i, p, f]
        self._decode.restype = None

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

    def paged_decode(self, q, out, rows, k_pool, v_pool, tables, lens, scale: float) -> None:
        """q, out: [T, Hq, D] contiguous fp32; rows, lens: int32 [B]; tables: int32 [B, W]."""
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
        )


def get() -> Kernels | None:
    """The compiled kernels, or None (no compiler, build failed, or disabled)."""
    global _kernels
    if _kernels is False:
        _kernels = None
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if os.environ.get("BITSERVE_NO_KERNELS") != "1" and compiler:
            try:
                _kernels = Kernels(build(compiler))
            except (OSError, subprocess.SubprocessError):
                _kernels = None
    return _kernels


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded kernels (tests): `enabled=False` forces the torch fallback."""
    global _kernels
    _kernels = None if enabled is False else False
