"""Building blocks shared by the model files: norms, rotary embeddings, paged attention.

Each block reproduces transformers' arithmetic (same dtype casts, same op order) so
greedy decoding is token-exact against `generate`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitserve.llm import kernels
from bitserve.llm.attention import AttentionMetadata, paged_attention
from bitserve.llm.parallel import TensorParallel

NO_TP = TensorParallel()

SMALL_M = 64  # up to this many rows the C kernel beats MKL (2-3x at M=1, ~1.4x at 16-64)


def use_kernel(m: int, k: int, n: int) -> bool:
    """Whether the C kernel beats MKL for m rows of k inputs and n outputs: always up to
    SMALL_M rows; at any m while the weight is small (<= 8 MiB: small models, whose
    decode batches and prefill the kernel runs in L2-sized row blocks at 1.3-1.5x MKL);
    big weights' many-row calls stay on MKL, whose cache blocking is made for them."""
    return m <= SMALL_M or n * k * 4 <= 8 << 20


class Linear(nn.Linear):
    """`nn.Linear` whose few-row calls (decode) go to the C kernel (kernels.py).

    MKL's fp32 GEMV reads the weights at ~15 GB/s on one core; the kernel reads them at
    the plain-sum bandwidth (~37 GB/s), which is what batch-1 decode is bound by.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 2
            and use_kernel(x.shape[0], x.shape[1], self.weight.shape[0])
            and x.dtype is torch.float32
            and self.weight.dtype is torch.float32
            and not torch.is_grad_enabled()
            and x.is_cpu
            and (k := kernels.get()) is not None
            and x.stride(1) == 1
            and self.weight.is_contiguous()
        ):
            return k.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(hf: dict[str, Any], head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies: default, linear and llama3 scaling."""
    params = rope_parameters(hf)
    base, kind = params["rope_theta"], params["rope_type"]
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        return llama3_scaling(inv_freq, params)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_model_len, looked up by position."""

    def __init__(self, hf: dict[str, Any], head_dim: int, max_len: int):
        super().__init__()
        self.inv_freq = inverse_frequencies(hf, head_dim)
        self.max_len = max_len
        self.reset_buffers()

    def reset_buffers(self, device: str | torch.device = "cpu") -> None:
        """Same arithmetic as transformers: fp32 position x inv_freq, cos/sin in fp32.

        Computed on the CPU (the same tables on every device), then moved to `device`.
        """
        freqs = (
            torch.arange(self.max_len, dtype=torch.float32, device="cpu")[:, None]
            * self.inv_freq[None, :]
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated, in their dtype. On the CPU in fp32
        the C kernel rotates them in place (they are fresh views of the qkv output)."""
        if self.c_rope(q, k) and (kern := kernels.get()) is not None:
            positions = positions.contiguous()
            kern.rope(q, positions, self.cos, self.sin)
            kern.rope(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def c_rope(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return (
            q.dtype is torch.float32
            and k.dtype is torch.float32
            and q.is_cpu
            and not torch.is_grad_enabled()
            and self.cos.shape[-1] == q.shape[-1]  # full-width rotary
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k))
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with GQA over the paged KV cache of one layer.

    Under tensor parallelism (parallel.py) this rank holds `num_heads / tp` query heads
    and `num_kv_heads / tp` kv heads: `qkv_proj` is column-parallel, `o_proj`
    row-parallel, and one all-reduce sums the partial outputs."""

    def __init__(
        self,
        hidden,
        num_heads,
        num_kv_heads,
        head_dim,
        bias: bool,
        o_bias: bool,
        tp: TensorParallel = NO_TP,
    ):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.scale = head_dim**-0.5
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the runner

    def forward(self, x, positions, meta: AttentionMetadata, rotary: RotaryEmbedding | None):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


def load_packed(param: torch.Tensor, tensor: torch.Tensor, shard: int, sizes: list[int]) -> None:
    """Copy one checkpoint tensor (q, k or v; gate or up) into its slice of a fused weight."""
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)
