"""The int8 C kernels against torch: the GEMV against F.linear on the dequantized
weights, the fused decode layer against the same layer run op by op in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bitserve.llm import LLM, SamplingParams
from bitserve.quant import fused, kernels
from bitserve.quant.linear import Int8Linear

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="no C compiler")


@pytest.mark.parametrize(("k", "n"), [(512, 384), (688, 64), (80, 100), (100, 7)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_gemv_is_the_dequantized_matmul_in_fp32(k, n, rows) -> None:
    torch.manual_seed(k + rows)
    linear = nn.Linear(k, n, bias=True).requires_grad_(False)
    layer = Int8Linear.from_float(linear)
    x = torch.randn(rows, 2 * k)[:, :k]  # a row stride that is not the width
    want = F.linear(x, layer.dequantize(), linear.bias)
    got = kernels.get().linear(kernels.qweight(layer), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_use_the_gemv_for_few_rows(monkeypatch) -> None:
    layer = Int8Linear.from_float(nn.Linear(64, 32).requires_grad_(False))
    x = torch.randn(2, 64)
    with torch.inference_mode():
        layer(x)
    assert layer.c_weight is not None
    calls = []
    monkeypatch.setattr(layer.c_kernels, "linear", lambda w, x: calls.append(1) or x[:, :32])
    with torch.inference_mode():
        layer(x)
        layer(torch.randn(16, 64))  # more rows: _int_mm
    assert calls == [1]


def test_fused_decode_layers_match_the_torch_path(quantized_tinylm, monkeypatch) -> None:
    prompt = "Blessed are the poor in spirit:"
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    llm = LLM(quantized_tinylm["int8"] / "1", num_kv_blocks=64)
    layers = llm.engine.runner.model.layers
    assert all(isinstance(layer, fused.FusedDecode) for layer in layers)
    calls = []
    original = fused.FusedDecode.fused
    monkeypatch.setattr(fused.FusedDecode, "fused", lambda *a: calls.append(1) or original(*a))
    fast = llm.generate(prompt, greedy)[0].outputs[0]
    assert len(calls) == 15 * len(layers)  # every decode step, every layer
    monkeypatch.setattr(fused.FusedDecode, "can_fuse", lambda *a: False)
    slow = llm.generate(prompt, greedy)[0].outputs[0]
    assert fast.token_ids == slow.token_ids
    for a, b in zip(fast.logprobs, slow.logprobs, strict=True):
        assert a.keys() == b.keys()
        assert max(abs(a[t] - b[t]) for t in a) < 1e-3
