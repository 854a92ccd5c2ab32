"""Quantized layers against torch's own float matmul on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels as c
from bitserve.llm.quant.linear import (
    SMALL_M,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    Int8OutlierLinear,
    quantize_rows_int8,
)

torch.manual_seed(0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def linear() -> nn.Linear:
    layer = nn.Linear(512, 384, bias=True).requires_grad_(False)
    layer.weight.normal_(0, 0.05)
    return layer


def test_int8_rows_are_symmetric_per_output_channel(linear) -> None:
    q, scale = quantize_rows_int8(linear.weight)
    assert q.dtype is torch.int8 and q.abs().amax(1).eq(127).all()
    assert torch.allclose(q.float() * scale[:, None], linear.weight, atol=float(scale.max()) / 2)


@pytest.mark.parametrize("rows", [1, SMALL_M, 16, 100])
def test_int8_linear_matches_the_dequantized_matmul(linear, rows) -> None:
    layer = Int8Linear.from_float(linear)
    x = torch.randn(rows, 512)
    want = F.linear(x, layer.dequantize(), linear.bias)
    got = layer(x)
    assert got.dtype is torch.float32 and got.shape == (rows, 384)
    assert layer.use_pack and layer.use_int_mm  # the fast kernels exist on this CPU
    assert rel(got, want) < 0.02  # bf16 activations (<= SMALL_M) or int8 activations
    assert rel(got, linear(x)) < 0.03


@pytest.mark.parametrize("kernels", ["C", "torch"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 16, 100])
def test_int4_linear_matches_the_dequantized_matmul(linear, group, rows, kernels, monkeypatch):
    if kernels == "torch":
        monkeypatch.setattr(c, "get", lambda: None)
    elif c.get() is None:
        pytest.skip("no C compiler")
    layer = Int4Linear.from_float(linear, group)
    assert layer.qweight.shape == (384, 256) and layer.scales.shape == (384, 512 // group)
    x = torch.randn(rows, 512)
    want = F.linear(x, layer.dequantize(), linear.bias)
    with torch.inference_mode():
        got = layer(x)
    assert (layer.c_weight is not None) == (kernels == "C")
    assert layer.use_pack == (kernels == "torch")  # int4pack only without the C kernels
    assert rel(got, want) < 0.01  # against its own dequantization (bf16 x)
    assert rel(got, linear(x)) < 0.15  # 4 bits of a Gaussian weight


def test_int4_pads_a_width_that_is_not_a_multiple_of_the_group() -> None:
    linear = nn.Linear(688, 64, bias=False).requires_grad_(False)
    layer = Int4Linear.from_float(linear, 32)
    assert layer.padded_in == 704
    x = torch.randn(3, 688)
    assert rel(layer(x), F.linear(x, layer.dequantize()[:, :688])) < 0.01


def test_int4_groups_map_min_and_max_to_the_ends(linear) -> None:
    layer = Int4Linear.from_float(linear, 32)
    q = layer.unpacked().view(384, -1, 32)
    assert q.amin(-1).eq(0).float().mean() > 0.9 and q.amax(-1).eq(15).float().mean() > 0.9


def test_outlier_columns_stay_exact_and_do_not_set_the_int8_scale(linear) -> None:
    x = torch.randn(16, 512)
    x[:, [7, 300]] *= 60.0  # two outlier channels
    plain = Int8Linear.from_float(linear)
    mixed = Int8OutlierLinear.from_float_with_outliers(linear, torch.tensor([7, 300]))
    want = linear(x)
    assert torch.equal(mixed.outlier_weight, linear.weight[:, [7, 300]])
    assert mixed.qweight[:, [7, 300]].eq(0).all()
    assert rel(mixed(x), want) < 0.015
    assert rel(plain(x), want) > 2 * rel(mixed(x), want)


def test_int8_embedding_rows(linear) -> None:
    embedding = nn.Embedding(100, 64).requires_grad_(False)
    layer = Int8Embedding.from_float(embedding)
    ids = torch.tensor([[1, 5, 99]])
    assert rel(layer(ids), embedding(ids)) < 0.01


def test_kernel_choice_can_fall_back_to_dequantize(linear, monkeypatch, caplog) -> None:
    from bitserve.llm.quant import linear as module

    def missing(*args):
        raise NotImplementedError("no such kernel here")

    monkeypatch.setattr(module, "_fallbacks_logged", set())
    monkeypatch.setattr(torch, "_int_mm", missing)
    layer = Int8Linear.from_float(linear)
    x = torch.randn(20, 512)
    with caplog.at_level("WARNING", "bitserve.quant"):
        got = layer(x)
    assert not layer.use_int_mm and "dequantize-and-matmul" in caplog.text
    assert rel(got, F.linear(x, layer.dequantize(), linear.bias)) < 0.02
