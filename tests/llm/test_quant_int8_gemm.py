"""csrc/qgemm.c's int8 x int8 GEMM (bitserve's own int8 with int8 activations) against
torch._int_mm: exact int32 sums, so the same bits, at odd shapes, 1..64 rows, on one and
two threads, and in builds without VNNI (AVX-512 without it, and plain C)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn

from bitserve import kernels
from bitserve.llm.quant.linear import Int8Linear

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")

# (N, K): tails of the 8-row W blocks and of the 64-column steps, K below one step
# (torch._int_mm is wrong at K = 1), and a layer shape of the 246M bench model
SHAPES = [(96, 200), (19, 64), (37, 3), (8, 130), (1024, 1024)]


def int8(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(
        -128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed)
    )


def int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch._int_mm, which wants more than 16 rows on some builds: padded with zero rows"""
    pad = max(0, 17 - x.shape[0])
    return torch._int_mm(torch.nn.functional.pad(x, (0, 0, 0, pad)), w.t())[: x.shape[0]]


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    lib = kernels.get().lib
    lib.bs_set_threads(request.param)
    yield request.param
    lib.bs_set_threads(1)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_gemm_is_int_mm_bit_for_bit(n, k, threads):
    lib = kernels.get()
    w = int8(n, k, seed=n * k)
    wsum = w.sum(1, dtype=torch.int32)
    rows = range(1, 65) if n * k < 1e5 else (1, 2, 3, 4, 5, 9, 16, 33, 64)
    for m in rows:
        x = int8(m, 2 * k, seed=m)[:, :k]  # a row stride that is not the width
        assert torch.equal(lib.i8_gemm(x, w, wsum), int_mm(x.contiguous(), w)), (m, n, k)


@pytest.mark.parametrize(("n", "k"), [(96, 200), (24, 64), (8, 130)])
def test_int8_layer_is_its_torch_path_bit_for_bit(n, k, threads):
    """The layer's C path (x rounded per row in C) against its torch._int_mm path, from 5
    rows (fewer keep x fp32); out a multiple of 8: torch's int8pack, which the layer
    probes, crashed on 19 rows. 130 and 300 rows: x is rounded on the pool in blocks of
    rows, and each task scales its own block of sums."""
    torch.manual_seed(n + k)
    layer = Int8Linear.from_float(nn.Linear(k, n).requires_grad_(False))
    with torch.inference_mode():
        for m in [*range(5, 65), 130, 300]:
            x = torch.randn(m, k) * (1 + m)
            got = layer(x)
            assert layer.c_weight is not None
            want = layer.int_mm_matmul(x) + layer.bias
            assert torch.equal(got, want), (m, n, k)


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v2"], ids=["avx512 no vnni", "plain C"])
def test_builds_without_vnni_give_the_same_sums(tmp_path, march):
    """qgemm.c (and the pool it splits work on) built for AVX-512 without VNNI, and for
    no AVX at all: the plain loop's sums are _int_mm's too."""
    cc = kernels.compiler()
    flags = ["-O2", f"-march={march}", "-mno-avx512vnni", "-fPIC", f"-I{kernels.CSRC}"]
    objects = []
    for name in ("qgemm", "pool"):
        obj = tmp_path / f"{name}.o"
        subprocess.run(
            [cc, *flags, "-c", str(kernels.CSRC / f"{name}.c"), "-o", str(obj)], check=True
        )
        objects.append(str(obj))
    path = tmp_path / "plain.so"
    subprocess.run([cc, "-shared", "-pthread", *objects, "-o", str(path), "-lm"], check=True)
    lib = kernels.ffi().dlopen(str(path))
    lib.bs_set_threads(2)
    for n, k in SHAPES[:4]:
        w = int8(n, k, seed=k)
        wsum = w.sum(1, dtype=torch.int32)
        for m in (1, 3, 8, 21):
            x = int8(m, k, seed=m)
            y = torch.empty(m, n, dtype=torch.int32)
            i8 = "int8_t *"
            i32 = "int32_t *"
            args = (kernels.ptr(x, i8), k, m, k, kernels.ptr(w, i8), kernels.ptr(wsum, i32), n)
            lib.bs_i8_gemm(*args, kernels.ptr(y, i32))
            assert torch.equal(y, int_mm(x, w)), (march, m, n, k)


def test_fp32_x_gemv_splits_over_the_pool_with_the_same_bits():
    """Up to 4 rows x stays fp32 (the GEMV, its output rows split over the pool): two
    threads give one thread's bits, and both the dequantized weights' product to fp32
    rounding. 200 outputs: a partial last task of 64."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(256, 200).requires_grad_(False))
    lib = kernels.get()
    with torch.inference_mode():
        layer(torch.randn(5, 256))  # prepares the C view
        for m in (1, 2, 3, 4):
            x = torch.randn(m, 256)
            lib.lib.bs_set_threads(1)
            one = lib.gemv(layer.c_weight, x)
            lib.lib.bs_set_threads(2)
            two = lib.gemv(layer.c_weight, x)
            lib.lib.bs_set_threads(1)
            assert torch.equal(one, two), m
            want = x @ layer.int8_weight().t()  # (the layer adds its bias after)
            torch.testing.assert_close(one, want, rtol=1e-4, atol=1e-4)
