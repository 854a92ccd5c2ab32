"""`EngineConfig.device` and the path a GPU takes, exercised on the CPU.

On cuda the C kernels are never used: every attention goes through the torch paths
(or flash-attn when it imports). Forcing `kernels.get()` to None runs that same code
on the CPU, so token-exactness there covers the control flow a GPU run takes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bitserve import kernels
from bitserve.llm.attention import FlashAttn
from bitserve.llm.config import EngineConfig
from tests.llm.conftest import make_engine
from tests.llm.test_engine import GREEDY, MIXED, assert_parity, generate


def test_device_auto_resolves_to_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda:1")


def test_device_auto_picks_cuda_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(num_kv_blocks=4)  # no free-GPU-memory query
    assert config.device == "cuda" and not config.on_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_is_cpu_here():
    config = EngineConfig()
    assert config.device == "cpu" and config.on_cpu


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "mps", "", 0])
def test_device_is_validated(device):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=device)


def test_explicit_cpu_without_kernels_is_token_exact(llama_dir, monkeypatch):
    """The no-kernel path (the one cuda takes) stays token-exact, chunks included."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    runner = engine.runner
    assert runner.kernels is None and runner.flash is None
    k_pool, _ = runner.attentions[0].kv_cache
    assert k_pool.device.type == "cpu" and k_pool.dtype is torch.float32
    assert runner.model.rotary.cos.device.type == "cpu"
    assert_parity(llama_dir, MIXED, generate(engine, MIXED))


def bottom_right_sdpa(q, k, v, scale):
    """q [n, Hq, D] against k, v [L, Hkv, D]; query i sees keys up to L - n + i."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    o = F.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


class FakeFlashAttn:
    """flash-attn's two entry points, with their argument layouts, done with SDPA."""

    def __init__(self):
        self.calls = {"varlen": 0, "with_kvcache": 0}

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
        self.calls["varlen"] += 1
        assert causal and cu_q.dtype is torch.int32 and q.dim() == 3
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        outs = []
        for i in range(len(cu_q) - 1):
            rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            outs.append(bottom_right_sdpa(q[rows_q], k[rows_k], v[rows_k], softmax_scale))
        return torch.cat(outs)

    def with_kvcache(self, q, k_cache, v_cache, softmax_scale=None, causal=False):
        self.calls["with_kvcache"] += 1
        assert causal and q.dim() == 4 and k_cache.dim() == 4
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert q.shape[2] % k_cache.shape[2] == 0 and k_cache.shape[1] >= q.shape[1]
        return torch.stack(
            [bottom_right_sdpa(q[b], k_cache[b], v_cache[b], softmax_scale) for b in range(len(q))]
        )


def test_flash_attn_plumbing_is_token_exact(llama_dir, monkeypatch):
    """The flash-attn calls (shapes, strides, causal alignment) through a SDPA stand-in."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    fake = FakeFlashAttn()
    engine.runner.flash = FlashAttn(fake.varlen, fake.with_kvcache)
    assert_parity(llama_dir, MIXED, generate(engine, MIXED, GREEDY))
    assert fake.calls["varlen"] > 0 and fake.calls["with_kvcache"] > 0


def test_flash_attn_is_never_picked_on_cpu(llama_dir):
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=8)
    assert engine.runner.flash is None
