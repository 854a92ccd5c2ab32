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

from bitserve import kernels as c
from bitserve.llm.attention import AttentionMetadata, paged_attention
from bitserve.llm.parallel import TensorParallel
from bitserve.llm.rope import rope_parameters

NO_TP = TensorParallel()

SMALL_M = 64  # up to this many rows the C kernel beats MKL (`python -m bench.kernels`)
SMALL_WEIGHT = 8 << 20  # bytes: below, the C kernel beats MKL at any row count


class Linear(nn.Linear):
    """`nn.Linear` whose few-row calls (decode) go to the C GEMV (`bs_linear`).

    The kernel streams each weight row once for all rows of x, at the read bandwidth,
    where MKL's small-M path does not; big weights' many-row calls stay on MKL, whose
    cache blocking is made for them. `python -m bench.kernels` measures both.
    """

    kernels: c.Kernels | None = None  # set when the model is loaded (kernels.attach)
    packed = False  # the weight holds `Kernels.pack`'s panels, not [N, K] rows

    def pack(self) -> None:
        """Store the weight as the packed GEMM's panels (same shape, same memory): from
        then on every call runs `bs_linear_packed` (fp32) or the bf16 kernel (kind 5), at
        any row count. Needs a weight on the CPU with a multiple of 16 outputs (and an
        even width in bf16); else the layer stays as it is."""
        w = self.weight
        if not (w.is_cpu and w.is_contiguous() and w.shape[0] % 16 == 0):
            return
        if w.dtype is torch.float32:
            self.weight.data = self.kernels.pack(w.data)
            self.packed = True
        elif w.dtype is torch.bfloat16 and w.shape[1] % 2 == 0:
            self.weight.data = self.kernels.pack_bf16(w.data)
            self.packed = True

    @property
    def fuse_rows(self) -> int:
        """Up to how many rows the C kernel beats MKL: any once packed; else SMALL_M, or
        any while the weight is small (in L2-sized row blocks)."""
        small = self.weight.numel() * 4 <= SMALL_WEIGHT
        return 1 << 30 if self.packed or small else SMALL_M

    def c_view(self, lora=None):
        """This layer as the C decode layer reads it (a `Weight`), or None; `lora`: its
        LoRA slots, added by the C layer too (llm/lora.py)."""
        if self.packed and self.weight.dtype is torch.bfloat16:
            return c.bf16_weight(self.weight, *self.weight.shape, self.bias, lora)
        if self.weight.dtype is not torch.float32 or not self.weight.is_contiguous():
            return None
        return c.fp32_weight(self.weight, self.bias, self.packed, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return self.packed_forward(x)
        if (
            self.kernels is not None
            and x.dim() == 2
            and x.shape[0] <= self.fuse_rows
            and x.dtype is torch.float32
            and self.weight.dtype is torch.float32
            and not torch.is_grad_enabled()
            and x.stride(1) == 1
            and self.weight.is_contiguous()
        ):
            return self.kernels.linear(x, self.weight, self.bias)
        # bf16 weights with fp32 x and no kernels: widened, so the products stay exact
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype is not torch.float32 or torch.is_grad_enabled():  # not serving
            return F.linear(x, self.unpacked().to(x.dtype), self.bias)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self.weight.dtype is torch.bfloat16:
            if getattr(self, "bf16_view", None) is None:  # built once (points at weight)
                self.bf16_view = self.c_view()
            y = self.kernels.gemv(self.bf16_view, rows)
        else:
            y = self.kernels.linear_packed(rows, self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])

    def unpacked(self) -> torch.Tensor:
        """The [N, K] weight, rebuilt from the panels (fp32's [N/16][K][16], bf16's
        [N/16][K/2][16][2])."""
        n, k = self.weight.shape
        if self.weight.dtype is torch.bfloat16:
            return self.weight.view(n // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(n, k)
        return self.weight.view(n // 16, k, 16).transpose(1, 2).reshape(n, k)


def store_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep every `Linear`'s weight in `dtype` (bf16 on the CPU: `dtype = "bfloat16"`),
    activations, norms, embeddings and biases as they are. A weight another module shares
    (a tied LM head reads the embedding) stays: the embedding would lose its precision."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for module in model.modules():
        if isinstance(module, Linear) and uses[id(module.weight)] == 1:
            module.weight.data = module.weight.data.to(dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm; `unit_offset` is Gemma's: the weight is stored as w - 1 and the
    product is taken in fp32 before the cast back (`x * (1 + w)`)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def scale(self) -> torch.Tensor:
        """The multiplier the C kernels read: the weight, or 1 + weight (Gemma)."""
        return (1.0 + self.weight.float()) if self.unit_offset else self.weight


ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "longrope", "yarn")


def inverse_frequencies(params: dict[str, Any], head_dim: int, ext=None) -> torch.Tensor:
    """RoPE inverse frequencies for default, linear, llama3, yarn, longrope (short
    factors, or `ext` given) scaling; `dynamic` starts as default (see RotaryEmbedding)."""
    base, kind = params["rope_theta"], params["rope_type"]
    dim = rotary_dim(params, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if kind == "longrope":
        factors = params["short_factor"] if ext is None else ext
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        return llama3_scaling(inv_freq, params)
    if kind == "yarn":
        return yarn_scaling(base**exponents, params, dim)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


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


def yarn_factor(params: dict[str, Any], max_positions: int) -> float:
    """YaRN's scaling factor: `factor`, or the ratio of the lengths when it is absent."""
    return params.get("factor") or max_positions / params["original_max_position_embeddings"]


def yarn_scaling(pos_freqs: torch.Tensor, params: dict[str, Any], dim: int) -> torch.Tensor:
    """YaRN (transformers' arithmetic): interpolated (1 / factor) frequencies for the
    slow dimensions, the original ones for the fast, a linear ramp between the
    dimensions that turn beta_slow and beta_fast times over the original length."""
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated, original = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + original * extrapolation


def yarn_attention_factor(params: dict[str, Any], max_positions: int) -> float:
    """transformers' default: 0.1 ln(factor) + 1, or the ratio of the two mscales."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    factor = yarn_factor(params, max_positions)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(params["mscale"]) / mscale(params["mscale_all_dim"]))
    return mscale(1)


def longrope_attention_factor(params: dict[str, Any], max_positions: int) -> float:
    """transformers' default for Phi-3: sqrt(1 + ln(factor) / ln(original length))."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def dynamic_frequencies(params: dict[str, Any], head_dim: int, max_pos: int, lengths):
    """Dynamic NTK: per sequence length L > max_pos, the base transformers recomputes, in
    its arithmetic (fp32 tensors): base * (factor L / max_pos - (factor - 1)) ** (d / (d - 2))."""
    dim, factor = rotary_dim(params, head_dim), params["factor"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    base = params["rope_theta"] * ((factor * lengths / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponents[None, :])


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_model_len, looked up by position.

    Two scalings depend on the sequence (`bitserve/llm/rope.py`): the token at position p
    of a sequence is rotated as transformers rotates it in a forward over
    L = max(S, p + 1) tokens, S being the sequence's `rope_prefix` (each row's is
    `meta.rope_prefix`). Rows [0, max_len) of the tables hold position p rotated for
    L = p + 1 (the short factors; dynamic NTK's base for max(p + 1,
    max_position_embeddings)), and
    - `longrope` (Phi-3): rows [max_len, 2 max_len) the long factors, taken when L is
      past original_max_position_embeddings;
    - `dynamic`: a prompt longer than max_position_embeddings rotates its tokens with the
      base for its whole length; those rows are computed per step into rows past
      max_len (`extra_rows`), grown when a step needs more.
    """

    kernels: c.Kernels | None = None  # RoPE in C (kernels.attach, at load)

    def __init__(self, hf: dict[str, Any], head_dim: int, max_len: int, layer_type=None):
        super().__init__()
        self.head_dim = head_dim
        self.params = rope_parameters(hf, layer_type)
        self.kind = self.params["rope_type"]
        self.inv_freq = inverse_frequencies(self.params, head_dim)
        self.max_len = max_len
        self.max_positions = int(hf.get("max_position_embeddings", max_len))
        self.reset_buffers()

    def reset_buffers(self, device: str | torch.device = "cpu") -> None:
        """Same arithmetic as transformers: fp32 position x inv_freq, cos/sin in fp32
        (times longrope's or yarn's attention factor). Computed on the CPU, moved to
        `device`."""
        positions = torch.arange(self.max_len, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        self.scale = 1.0
        if self.kind == "dynamic" and self.max_len > self.max_positions:
            start = self.max_positions
            lengths = torch.arange(start + 1, self.max_len + 1, dtype=torch.int64, device="cpu")
            inv = dynamic_frequencies(self.params, self.head_dim, start, lengths)
            freqs[start:] = positions[start:, None] * inv
        if self.kind == "longrope":
            long = inverse_frequencies(self.params, self.head_dim, self.params["long_factor"])
            freqs = torch.cat([freqs, positions[:, None] * long[None, :]])
            self.scale = longrope_attention_factor(self.params, self.max_positions)
        if self.kind == "yarn":
            self.scale = yarn_attention_factor(self.params, self.max_positions)
        self.cos, self.sin = self.tables(freqs, device)

    def tables(self, freqs: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(device), (emb.sin() * self.scale).to(device)

    def table_positions(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The table row of each token: its position, or the row of its rotation when
        that depends on its sequence's length (see the class)."""
        if self.kind not in ("longrope", "dynamic"):
            return positions
        lens = torch.maximum(meta.rope_prefix, positions + 1)
        if self.kind == "longrope":
            original = self.params["original_max_position_embeddings"]
            return positions + (lens > original) * self.max_len
        own = torch.clamp(positions + 1, min=self.max_positions)  # what rows [0, max_len) hold
        odd = (lens > own).nonzero().squeeze(1)
        if odd.numel() == 0:
            return positions
        rows = positions.clone()
        rows[odd] = self.extra_rows(positions[odd], lens[odd])
        return rows

    def extra_rows(self, positions: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Dynamic: write position p rotated for length L into rows past max_len, one per
        token; returns their rows. The tables grow (new tensors) when they are short."""
        n, device = len(positions), self.cos.device
        if self.cos.shape[0] < self.max_len + n:
            grown = self.max_len + max(n, 2 * (self.cos.shape[0] - self.max_len), 256)
            pad = torch.zeros(grown - self.max_len, self.cos.shape[1], device=device)
            self.cos = torch.cat([self.cos[: self.max_len], pad])
            self.sin = torch.cat([self.sin[: self.max_len], pad])
        inv = dynamic_frequencies(self.params, self.head_dim, self.max_positions, lens.cpu())
        cos, sin = self.tables(positions.cpu().float()[:, None] * inv, device)
        rows = slice(self.max_len, self.max_len + n)
        self.cos[rows], self.sin[rows] = cos, sin
        return torch.arange(self.max_len, self.max_len + n, device=positions.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated, in their dtype. On the CPU in fp32
        the C kernel rotates them in place (they are fresh views of the qkv output)."""
        if self.kernels is not None and self.c_rope(q, k):
            positions = positions.contiguous()
            self.kernels.rope(q, positions, self.cos, self.sin)
            self.kernels.rope(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        rot = cos.shape[-1]
        if rot < q.shape[-1]:  # partial rotary (Phi-4-mini): the tail passes through
            q_rot, q_pass = q[..., :rot], q[..., rot:]
            k_rot, k_pass = k[..., :rot], k[..., rot:]
            q = torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q_pass], dim=-1)
            k = torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k_pass], dim=-1)
            return q, k
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def c_rope(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        return (
            q.dtype is torch.float32
            and k.dtype is torch.float32
            and not torch.is_grad_enabled()
            and self.cos.shape[-1] == q.shape[-1]  # full-width rotary
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k))
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with GQA over the paged KV cache of one layer.

    The variations the families need live here, not in copies per model: `qk_norm`
    (Qwen3, Gemma 3: an RMSNorm over each head's q and k before RoPE, given as the norm
    to build), `window` (sliding-window layers: a query sees its last `window` keys),
    `softcap` (Gemma 2: `cap * tanh(scores / cap)` before the softmax) and `scale`
    (Gemma's `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`).

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
        *,
        qk_norm=None,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.window, self.softcap = window, softcap
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the runner

    kernels: c.Kernels | None = None  # paged decode in C (kernels.attach, at load)

    def forward(self, x, positions, meta: AttentionMetadata, rotary: RotaryEmbedding | None):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        out = paged_attention(
            q, k, v, self.kv_cache, meta, self.scale, self.window, self.softcap, self.kernels
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


def load_packed(param: torch.Tensor, tensor: torch.Tensor, shard: int, sizes: list[int]) -> None:
    """Copy one checkpoint tensor (q, k or v; gate or up) into its slice of a fused weight."""
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)
