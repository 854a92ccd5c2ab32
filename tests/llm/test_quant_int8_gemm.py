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
from tests.llm.conftest import record_decode_rows

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


def gemv_at(lib, threads: int, weight, x: torch.Tensor) -> torch.Tensor:
    """The C GEMV on `threads` threads of the pool (then back to one)."""
    lib.lib.bs_set_threads(threads)
    try:
        return lib.gemv(weight, x)
    finally:
        lib.lib.bs_set_threads(1)


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
            one, two = (gemv_at(lib, threads, layer.c_weight, x) for threads in (1, 2))
            assert torch.equal(one, two), m
            want = x @ layer.int8_weight().t()  # (the layer adds its bias after)
            torch.testing.assert_close(one, want, rtol=1e-4, atol=1e-4)


def test_a_prompt_step_past_256_rows_runs_the_c_layer(tmp_path, monkeypatch):
    """int8 with int8 activations: a step of more than 256 prompt rows (a burst of
    prompts) runs the C decoder layer too, in chunks of FUSED_CHUNK rows. Its rows do not
    depend on the chunking (the same bits in chunks of 128 and of 512). Against the torch
    path, whose norms, RoPE and attention round differently (so that now and then an
    activation rounds to the next int8 code): the same greedy tokens as it and as the fp32
    model, and logprobs nearer the torch path's than the torch path's are to fp32's (the
    quantization's own error; a wrong chunk or row would be far off)."""
    from bitserve.llm.engine import LLM
    from bitserve.llm.models import llama
    from bitserve.llm.sampling_params import SamplingParams
    from bitserve.quantize.command import _quantize_llm
    from bitserve.quantize.folders import resolve_source
    from tests.quant.conftest import TINYLM

    torch.set_num_threads(1)
    out = tmp_path / "tinylm-int8"
    _quantize_llm(resolve_source(TINYLM), out, "int8", 32, 6.0, None, 0, None)
    verses = TINYLM.joinpath("heldout.txt").read_text().split("\n")
    prompts = [" ".join(verses[3 * i : 3 * i + 3])[:400] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=1)

    def generate(llm) -> list:
        return [o.outputs[0] for o in llm.generate(prompts, greedy)]

    def median_gap(a: list, b: list) -> float:
        pairs = [
            (x, y)
            for f, g in zip(a, b, strict=True)
            for x, y in zip(f.logprobs, g.logprobs, strict=True)
        ]
        gaps = sorted(abs(x[t] - y[t]) for x, y in pairs for t in x)
        return gaps[len(gaps) // 2]

    llm = LLM(out / "1", num_kv_blocks=256, enable_prefix_caching=False)  # every row run
    rows = record_decode_rows(monkeypatch)
    whole = generate(llm)
    assert rows[0] > 256  # the prompts' step, one call a layer
    monkeypatch.setattr(llama, "FUSED_CHUNK", 128)
    rows.clear()
    chunked = generate(llm)
    assert sum(rows[:3]) > 256 and max(rows) == 128
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    assert [o.logprobs for o in chunked] == [o.logprobs for o in whole]
    monkeypatch.setattr(llm.engine.runner.model, "fuse_rows", 0)  # the torch path
    torch_path = generate(llm)
    fp32 = LLM(TINYLM / "1", num_kv_blocks=256, enable_prefix_caching=False)
    fp32.engine.runner.model.fuse_rows = 0
    reference = generate(fp32)
    tokens = [o.token_ids for o in whole]
    assert tokens == [o.token_ids for o in torch_path] == [o.token_ids for o in reference]
    assert median_gap(whole, torch_path) < median_gap(torch_path, reference)


def test_int4_gemm_splits_over_the_pool_with_the_same_bits():
    """csrc/qgemm.c's int4 kernel, tiles and chunks of 64 rows of x over the pool: two
    threads give one thread's bits (200 outputs: a partial last tile and task; 70 rows: a
    second chunk)."""
    from bitserve.llm.quant.linear import Int4Linear

    torch.manual_seed(1)
    layer = Int4Linear.from_float(nn.Linear(256, 200).requires_grad_(False))
    lib = kernels.get()
    with torch.inference_mode():
        layer(torch.randn(5, 256))  # prepares the C view
        for m in (1, 3, 9, 70):
            x = torch.randn(m, 256)
            one, two = (gemv_at(lib, threads, layer.c_weight, x) for threads in (1, 2))
            assert torch.equal(one, two), m
            want = x @ layer.dequantize().t()
            torch.testing.assert_close(one, want, rtol=0.05, atol=0.05)
