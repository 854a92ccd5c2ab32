"""bitserve/kernels/csrc/ggml.c against llama.cpp's own Python dequantizer.

Each block format is filled with random bytes (every bit pattern is a valid block once
its fp16 scales are finite), so the nibble, high-bit and 6-bit-scale unpacking is
checked on all of its cases, not only on what a quantizer happens to write. The
reference is gguf-py's `gguf.quants.dequantize` (llama.cpp's, not ours) @ x in fp64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve import kernels
from bitserve.llm.quant.ggml import TYPES, GgmlLinear, dequantize, row_bytes

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")

SCALES = {  # byte offsets of each block's fp16 scales (d, dmin), and the block size
    "Q4_0": ([0], 18),
    "Q5_0": ([0], 22),
    "Q8_0": ([0], 34),
    "Q4_K": ([0, 2], 144),
    "Q5_K": ([0, 2], 176),
    "Q6_K": ([208], 210),
}


def random_rows(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """rows of `kind` with random codes and finite random fp16 scales (uint8 [rows, bytes])."""
    rng = np.random.default_rng(seed)
    if kind in ("F32", "F16", "BF16"):
        w = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        w = w.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind])
        return w.contiguous().view(torch.uint8).view(rows, -1)
    data = rng.integers(0, 256, (rows, row_bytes(kind, k)), dtype=np.uint8)
    offsets, size = SCALES[kind]
    blocks = data.reshape(rows, -1, size)
    for off in offsets:
        scale = (rng.random(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, off : off + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return torch.from_numpy(data)


def reference(kind: str, data: torch.Tensor, k: int) -> torch.Tensor:
    """gguf-py's dequantization, fp64 [rows, k]."""
    raw = data.numpy()
    if kind in ("F16", "BF16", "F32"):
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[kind]
        return data.view(dtype).view(data.shape[0], k).double()
    array = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(array, dtype=np.float64)).view(data.shape[0], k)


QUANTS = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@needs_kernels
@pytest.mark.parametrize("kind", [*QUANTS, "F16", "BF16", "F32"])
def test_dequantize_is_llama_cpps(kind):
    k = 512
    data = random_rows(kind, 5, k, seed=TYPES[kind])
    got = dequantize(kind, data, k)
    torch.testing.assert_close(got.double(), reference(kind, data, k), rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("kind", QUANTS)
def test_gemv_is_dequantize_then_matmul(kind):
    """1-8 rows (dequantized in registers) and 16 (panels); odd row counts, 2-3 super-blocks."""
    for n, k in [(37, 512), (70, 768)]:
        data = random_rows(kind, n, k, seed=n)
        layer = GgmlLinear(k, [(kind, data)], activations="fp32")
        layer.kernels = kernels.get()
        w = reference(kind, data, k)
        for m in (1, 3, 8, 16):
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, k + 5, generator=g)[:, :k]  # strided rows
            want = x.double() @ w.T
            tol = 1e-4 * want.abs().max()
            torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=tol)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_0", "Q5_0", "Q8_0"])
def test_blocks_of_32_take_any_whole_number_of_blocks(kind):
    k, n = 96, 19  # three blocks a row: no multiple of 64 or 256
    data = random_rows(kind, n, k, seed=7)
    for m in (1, 5):
        x = torch.randn(m, k)
        layer = GgmlLinear(k, [(kind, data)], activations="fp32")
        layer.kernels = kernels.get()
        want = x.double() @ reference(kind, data, k).T
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 16])
def test_mixed_parts_with_bias_on_the_pool(m):
    """A fused qkv of a Q4_K_M file: Q4_K q and k, Q6_K v; plus an F16 part and a bias."""
    k = 256
    parts = [("Q4_K", random_rows("Q4_K", 64, k, 1)), ("Q4_K", random_rows("Q4_K", 33, k, 2))]
    parts += [("Q6_K", random_rows("Q6_K", 40, k, 3)), ("F16", random_rows("F16", 5, k, 4))]
    bias = torch.randn(142)
    layer = GgmlLinear(k, parts, bias, activations="fp32")
    layer.kernels = kernels.get()
    w = torch.cat([reference(kind, data, k) for kind, data in parts])
    x = torch.randn(m, k)
    want = x.double() @ w.T + bias.double()
    lib = kernels.get().lib
    for threads in (1, 2):
        lib.bs_set_threads(threads)
        try:
            got = layer(x)
        finally:
            lib.bs_set_threads(1)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())
    # and the torch fallback (no kernels) agrees
    plain = GgmlLinear(k, parts, bias, activations="fp32")
    torch.testing.assert_close(plain(x).double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's q8_0 rounds activations: per 32 columns, absmax / 127."""
    b = x.double().reshape(x.shape[0], -1, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).float().double()
    q = torch.round(b / torch.where(d > 0, d, 1)).clamp(-127, 127)
    return (q * d).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("kind", QUANTS)
def test_int8_activations_are_the_dequantized_weights_times_rounded_x(kind):
    """The default (gguf_activations "int8"): the codes repacked into tiles, x rounded to
    int8 per 32 columns; the result is gguf-py's W against that rounded x, to fp32
    rounding (not to x's rounding). 1..64 rows (the microkernel's 4-row blocks and their
    tails), 1-2 tiles a task, 1-2 threads; an F16 part and a bias beside it."""
    k = 512
    parts = [(kind, random_rows(kind, 37, k, seed=3)), ("F16", random_rows("F16", 3, k, 4))]
    bias = torch.randn(40)
    layer = GgmlLinear(k, parts, bias)
    w = reference(kind, parts[0][1], k)
    f16 = reference("F16", parts[1][1], k)
    layer.kernels = kernels.get()
    assert layer._c_parts[0].tiles != kernels.ffi().NULL  # the a8 path, not fp32
    assert layer.part0.numel() == 0 and layer.part1.numel() > 0  # the file's bytes dropped
    lib = kernels.get().lib
    for m, threads in [(1, 1), (2, 2), (3, 2), (5, 1), (9, 1), (16, 2), (31, 1), (64, 2)]:
        x = torch.randn(m, k + 3, generator=torch.Generator().manual_seed(m))[:, :k]
        want = torch.cat([quantized_x(x) @ w.T, x.double() @ f16.T], 1) + bias.double()
        lib.bs_set_threads(threads)
        try:
            got = layer(x).double()
        finally:
            lib.bs_set_threads(1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
        plain = x.double() @ w.T  # and x's rounding shows: this is not the fp32 path
        assert (got[:, :37] - plain).abs().max() > 1e-4 * plain.abs().max()
    # the weights read back from the tiles (the torch fallback's) are gguf-py's
    torch.testing.assert_close(layer.dequantize()[:37].double(), w, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_int8_activations_at_odd_shapes():
    """Output rows not a multiple of 16 or 32 (a tile's tail), three blocks of 32 a row
    (no multiple of 64 or 256) and a Q4_K part of 2 super-blocks: every row count 1..9."""
    for kind, n, k in [("Q8_0", 19, 96), ("Q4_0", 50, 96), ("Q4_K", 45, 512), ("Q6_K", 17, 256)]:
        data = random_rows(kind, n, k, seed=n)
        layer = GgmlLinear(k, [(kind, data)])
        layer.kernels = kernels.get()
        w = reference(kind, data, k)
        for m in range(1, 10):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want = quantized_x(x) @ w.T
            got = layer(x).double()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_gguf_activations_must_be_int8_or_fp32():
    with pytest.raises(ValueError, match="gguf_activations must be 'int8' or 'fp32', got 'int4'"):
        GgmlLinear(256, [("Q4_K", torch.zeros(1, 144, dtype=torch.uint8))], activations="int4")


@pytest.mark.slow
@needs_kernels
def test_int8_activations_without_avx512_give_the_same_sums(tmp_path, monkeypatch):
    """A build for a CPU without AVX-512 (x86-64-v3: AVX2, FMA, F16C) takes ggml.c's
    plain a8 loop: the same tiles, the same result."""
    monkeypatch.setenv("BITSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "COMPILE_FLAGS", ["-O2", "-march=x86-64-v3", "-fPIC"])
    plain = kernels.Kernels(kernels.build(kernels.compiler()))
    k = 256
    for kind in QUANTS:
        data = random_rows(kind, 21, k, seed=5)
        layer = GgmlLinear(k, [(kind, data)])
        layer.kernels = plain
        w = reference(kind, data, k)
        for m in (1, 6, 9):
            x = torch.randn(m, k)
            want = quantized_x(x) @ w.T
            got = layer(x).double()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())


@needs_kernels
def test_row_bytes_refuses_what_the_kernels_do_not_read():
    lib = kernels.get().lib
    assert lib.bs_ggml_row_bytes(TYPES["Q4_K"], 512) == 288
    assert lib.bs_ggml_row_bytes(TYPES["Q4_K"], 100) == -1  # not whole super-blocks
    assert lib.bs_ggml_row_bytes(10, 256) == -1  # Q2_K
    with pytest.raises(ValueError, match="whole blocks"):
        GgmlLinear(100, [("Q4_K", torch.zeros(1, 144, dtype=torch.uint8))])


@needs_kernels
def test_ggml_part_layout_is_the_compilers():
    ffi, lib = kernels.ffi(), kernels.get()
    fields = [name for name, _ in ffi.typeof("GgmlPart").fields]
    assert {f: lib.layout("GgmlPart", f) for f in fields} == {
        f: ffi.offsetof("GgmlPart", f) for f in fields
    }
    assert lib.layout("GgmlPart") == ffi.sizeof("GgmlPart")
    assert lib.layout("Weight", "parts") == ffi.offsetof("Weight", "parts")


@needs_kernels
def test_the_plain_c_build_gives_the_same_values(tmp_path):
    """Without AVX-512 (x86-64-v2) ggml.c runs its plain-C dequantizers and dot: built
    here from ggml.c and what it calls (gemm.c, pool.c) alone, checked like the rest."""
    import subprocess

    cc = kernels.compiler()
    flags = ["-O2", "-march=x86-64-v2", "-fPIC", f"-I{kernels.CSRC}"]
    objects = []
    for name in ("ggml", "gemm", "pool"):
        obj = tmp_path / f"{name}.o"
        source = kernels.CSRC / f"{name}.c"
        subprocess.run([cc, *flags, "-c", str(source), "-o", str(obj)], check=True)
        objects.append(str(obj))
    lib_path = tmp_path / "plain.so"
    subprocess.run([cc, "-shared", "-pthread", *objects, "-o", str(lib_path), "-lm"], check=True)
    lib = kernels.ffi().dlopen(str(lib_path))
    k = 512
    for kind in QUANTS:
        data = random_rows(kind, 9, k, seed=TYPES[kind] + 1)
        want = reference(kind, data, k)
        out = torch.empty(9, k)
        lib.bs_ggml_dequantize(TYPES[kind], kernels.ptr(data, "void *"), 9, k, kernels.ptr(out))
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-7)
        parts = kernels.ffi().new("GgmlPart[]", [{"type": TYPES[kind], "rows": 9,
                                                 "data": kernels.ptr(data, "void *")}])  # fmt: skip
        weight = kernels.ffi().new("Weight *", {"kind": 4, "N": 9, "K": k, "parts": parts,
                                                "nparts": 1})  # fmt: skip
        for m in (1, 5):
            x = torch.randn(m, k)
            y = torch.empty(m, 9)
            lib.bs_ggml_gemv(weight, kernels.ptr(x), k, m, kernels.ptr(y))
            torch.testing.assert_close(y.double(), x.double() @ want.T, rtol=1e-4, atol=1e-3)
