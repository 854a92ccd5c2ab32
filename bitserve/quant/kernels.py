"""C kernels for int8 decode on the CPU: an int8 GEMV and a fused decoder layer.

Batch-1 decode reads every weight once per token, so it runs at the speed weights stream
from memory. torch's `_weight_int8pack_mm` reads int8 weights at ~16 GB/s here, while
bitserve's own fp32 GEMV (bitserve/llm/kernels.py) reads fp32 at ~37 GB/s: int8 through
torch is only ~1.7x faster than fp32, and the ~600 small torch ops of an unfused decode
step cost about as much again. So, like the fp32 engine, int8 models decode through C:

- `bs_qgemv`: y = x @ W.T + b for a few rows, W int8 with a scale per output row. Each
  weight row is widened to fp32 in registers once per tile of up to 4 rows of x;
  activations stay fp32, so the result is the dequantized weights times x, in fp32
  (~31 GB/s of int8 here, 3.3x the fp32 GEMV on the 58M bench model's layers).
- `bs_q_llama_decode_layer`: bitserve/llm/kernels.py's fused Llama decode layer with
  `bs_qgemv` in place of its fp32 GEMV. It is compiled in one unit with that file's
  SOURCE and reuses its RMSNorm, RoPE and paged attention, so the steps are the same.

An int4 GEMV was written too (fp32 activations, nibbles widened in registers); it read
weights at half the rate of torch's `_weight_int4pack_mm_for_cpu`, which int4 keeps.
Built and cached the way bitserve/llm/kernels.py builds its own (gcc, -march=native,
ctypes); without a compiler, or with BITSERVE_NO_KERNELS=1, `get()` is None and the
int8 layers keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bitserve.llm import kernels as llm_kernels

Q_SOURCE = r"""
#include <stdint.h>

typedef struct {
    const int8_t *q; /* [N, K] */
    const float *scale; /* [N] */
    const float *bias; /* [N] or NULL */
    long N, K;
} QWeight;

#ifdef __AVX512F__
/* rows r < R of x (row stride ldx) against weight row n; R is a constant after inlining,
   so the 4 x R accumulators stay in registers and each weight vector is widened once. */
static inline __attribute__((always_inline)) void q8_tile(const QWeight *w, const float *x,
                                                          long ldx, long n, float *out,
                                                          const long R) {
    const int8_t *wn = w->q + n * w->K;
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
    const int8_t *wn = w->q + n * w->K;
    float t = 0.f;
#pragma omp simd reduction(+ : t)
    for (long k = 0; k < w->K; k++) t += (float)wn[k] * x[k];
    *out = t;
}

/* y [M, N] = x [M, K] (row stride ldx) @ (q * scale).T + bias */
void bs_qgemv(const QWeight *w, const float *x, long ldx, long M, float *y) {
    long N = w->N;
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
    for (long m = 0; m < M; m++) {
        float *row = qkv + m * QKV;
        const float *c = p->cos + positions[m] * D, *s = p->sin + positions[m] * D;
        for (long hd = 0; hd < Hq + Hkv; hd++) rope(row + hd * D, c, s, D);
        long blk = slots[m] / p->bs, off = slots[m] % p->bs;
        for (long g = 0; g < Hkv; g++) {
            long dst = ((g * p->nblk + blk) * p->bs + off) * D;
            memcpy(p->kpool + dst, row + (Hq + g) * D, sizeof(float) * D);
            memcpy(p->vpool + dst, row + (Hq + Hkv + g) * D, sizeof(float) * D);
        }
    }
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
        *[(name, ctypes.c_void_p) for name in ("q", "scale", "bias")],
        *[(name, ctypes.c_long) for name in ("N", "K")],
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


def build(compiler: str) -> Path:
    """Compile into a cached shared object, as bitserve/llm/kernels.py does."""
    flags = [*llm_kernels.COMPILE_FLAGS, *llm_kernels.FAST_MATH]
    text = source()
    key = hashlib.sha256(
        "\0".join([text, *flags, compiler, llm_kernels.cpu_signature()]).encode()
    ).hexdigest()[:16]
    folder = llm_kernels.cache_dir()
    target = folder / f"bitserve_quant_{key}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, obj, lib = Path(tmp) / "q.c", Path(tmp) / "q.o", Path(tmp) / "q.so"
        src.write_text(text)
        run = dict(check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *flags, "-c", str(src), "-o", str(obj)], **run)
        link = [compiler, "-shared", str(obj), "-o", str(lib)]
        try:
            subprocess.run([*link, "-lmvec", "-lm"], **run)
        except subprocess.CalledProcessError:
            subprocess.run([*link, "-lm"], **run)
        os.replace(lib, target)
    return target


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qweight(layer, bias: bool = True) -> QWeight:
    """The C view of an Int8Linear (pointers into its buffers, which must stay alive)."""
    return QWeight(
        q=layer.qweight.data_ptr(),
        scale=layer.scales.data_ptr(),
        bias=ptr(layer.bias) if bias else None,
        N=layer.out_features,
        K=layer.in_features,
    )


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
        tables = decode.block_tables
        self._layer(
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


def get() -> QuantKernels | None:
    global _kernels
    if _kernels is False:
        _kernels = None
        compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if os.environ.get("BITSERVE_NO_KERNELS") != "1" and compiler:
            try:
                _kernels = QuantKernels(build(compiler))
            except (OSError, subprocess.SubprocessError):
                _kernels = None
    return _kernels


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded kernels (tests): `enabled=False` forces the torch paths."""
    global _kernels
    _kernels = None if enabled is False else False
