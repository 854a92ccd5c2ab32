"""The C kernels against torch: the int8 and int4 GEMVs against F.linear on the
dequantized weights, the decode layer with quantized weights against the same layer op by
op in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels
from bitserve.llm import LLM, SamplingParams
from bitserve.llm.quant.linear import Int4Linear, Int8Linear, qweight
from bitserve.quantize.folders import resolve_source
from tests.llm.conftest import record_decode_rows

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="no C compiler")


@pytest.mark.parametrize(("k", "n"), [(512, 384), (688, 64), (80, 100), (100, 7)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_int8_gemv_is_the_dequantized_matmul_in_fp32(k, n, rows) -> None:
    torch.manual_seed(k + rows)
    linear = nn.Linear(k, n, bias=True).requires_grad_(False)
    layer = Int8Linear.from_float(linear)
    x = torch.randn(rows, 2 * k)[:, :k]  # a row stride that is not the width
    want = F.linear(x, layer.dequantize(), linear.bias)
    got = kernels.get().gemv(qweight(layer), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def blockwise_int8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the int4 kernel sees it: int8 in blocks of 32 columns, absmax / 127 each."""
    pad = -x.shape[1] % block
    xb = F.pad(x, (0, pad)).view(x.shape[0], -1, block)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb / scale.where(scale > 0, 1.0)).clamp(-127, 127)
    return (q * scale).view(x.shape[0], -1)[:, : x.shape[1]]


@pytest.mark.parametrize(("k", "n"), [(512, 384), (688, 64), (80, 100), (100, 7)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9, 70])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemv_is_the_dequantized_matmul_on_blockwise_int8_x(k, n, rows, group) -> None:
    torch.manual_seed(k + rows)
    linear = nn.Linear(k, n, bias=True).requires_grad_(False)
    layer = Int4Linear.from_float(linear, group)
    x = torch.randn(rows, 2 * k)[:, :k]
    weight = layer.dequantize()[:, :k]
    got = kernels.get().gemv(qweight(layer), x)
    # exactly the dequantized weights times x quantized as llama.cpp's q8_0 does ...
    want = F.linear(blockwise_int8(x), weight, linear.bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # ... which is within int8 rounding of the fp32 product
    exact = F.linear(x, weight, linear.bias)
    assert (got - exact).norm() / exact.norm() < 1e-2


@pytest.mark.parametrize("rows", [5, 8, 13])
def test_int8_activation_path_is_int_mm(rows) -> None:
    """From 5 rows, int8 with int8 activations runs VNNI in C on the same per-row int8
    activations as the torch._int_mm path: the same sums and roundings, the same bits."""
    torch.manual_seed(rows)
    layer = Int8Linear.from_float(nn.Linear(200, 96).requires_grad_(False))  # 200: a tail
    layer.prepare()
    x = torch.randn(rows, 200)
    got = kernels.get().gemv(layer.c_weight, x)
    assert torch.equal(got, layer.int_mm_matmul(x))


def test_layers_use_the_gemv_for_few_rows(monkeypatch) -> None:
    """W8A8 takes the C int8 GEMM at every row count, weight-only int8 up to 4 rows."""
    w8a8 = Int8Linear.from_float(nn.Linear(64, 32).requires_grad_(False))
    linear = nn.Linear(64, 32).requires_grad_(False)
    w8a16 = Int8Linear.from_float(linear, int8_activations=False)
    for layer, want in ((w8a8, [1, 1]), (w8a16, [1])):
        x = torch.randn(2, 64)
        with torch.inference_mode():
            layer(x)
        assert layer.c_weight is not None
        calls: list[int] = []
        monkeypatch.setattr(layer.c_kernels, "gemv", lambda w, x, c=calls: c.append(1) or x[:, :32])
        with torch.inference_mode():
            layer(x)
            layer(torch.randn(16, 64))  # more rows: C for W8A8, torch for weight-only
        assert calls == want


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fused_decode_layers_match_the_torch_path(quantized_tinylm, monkeypatch, method) -> None:
    prompt = "Blessed are the poor in spirit:"
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    llm = LLM(quantized_tinylm[method] / "1", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.fuse_rows >= 256  # chosen once, at load (int8: any row count)
    calls = []
    original = kernels.Kernels.decode_layer
    monkeypatch.setattr(kernels.Kernels, "decode_layer", lambda *a: calls.append(1) or original(*a))
    fast = llm.generate(prompt, greedy)[0].outputs[0]
    # every decode step, every layer, and the prompt's step too (up to 256 rows)
    assert len(calls) == 16 * len(model.layers)
    monkeypatch.setattr(model, "fuse_rows", 0)  # the torch path, layer by layer
    slow = llm.generate(prompt, greedy)[0].outputs[0]
    assert fast.token_ids == slow.token_ids
    diffs = []
    for a, b in zip(fast.logprobs, slow.logprobs, strict=True):
        assert a.keys() == b.keys()
        diffs += [abs(a[t] - b[t]) for t in a]
    if method == "int8":
        assert max(diffs) < 1e-3
    else:
        # int4 quantizes activations to int8 (per 32 columns): where the two paths' fp32
        # op orders put an activation on either side of a rounding boundary, one code
        # differs, and the step's logprob moves by up to ~1e-2 (1.3e-2 measured on an
        # AVX512-VNNI machine); most steps differ by far less, and a wrong layer by far more
        assert sorted(diffs)[len(diffs) // 2] < 2e-3 and max(diffs) < 3e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_batched_decode_is_fused_and_matches(quantized_tinylm, monkeypatch, method) -> None:
    prompts = ["And God said,", "The LORD is my shepherd;", "In the beginning", "Woe unto"]
    prompts *= 3  # int8 and int4 fuse up to 256 rows
    greedy = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(quantized_tinylm[method] / "1", num_kv_blocks=128)
    rows = record_decode_rows(monkeypatch)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert len(prompts) in rows  # all decodes in one call per layer
    monkeypatch.setattr(llm.engine.runner.model, "fuse_rows", 0)
    slow = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert fast == slow


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_qk_norm_and_sandwich_layers_run_the_c_layer(tmp_path, monkeypatch, arch, method):
    """The one C decode layer carries qk-norm (Qwen3) and sandwich norms, GeGLU and
    soft-caps (Gemma 2) for quantized weights too; tokens equal the torch path's."""
    from bitserve.quantize.command import _quantize_llm
    from tests.llm import test_architectures as archs
    from tests.llm.conftest import build_model

    source = build_model(tmp_path / arch, getattr(archs, arch)())
    out = tmp_path / f"{arch}-{method}"
    _quantize_llm(resolve_source(source), out, method, 32, 6.0, None, 0, None)
    llm = LLM(out, num_kv_blocks=64)  # a bare folder in, a bare folder out
    model = llm.engine.runner.model
    assert model.fuse_rows > 0
    calls = []
    original = kernels.Kernels.decode_layer
    monkeypatch.setattr(kernels.Kernels, "decode_layer", lambda *a: calls.append(1) or original(*a))
    prompts = [[5, 9, 2, 7, 11], [3, 8, 8, 1]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert calls
    monkeypatch.setattr(model, "fuse_rows", 0)
    assert fast == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
