"""The Llama-shaped decoder every RoPE family here shares: Llama 2/3, Mistral, Qwen2,
and (their own modules, one `Style` each) Qwen3, Gemma 2/3, Phi-3 and the MoE models.

One decoder: RMSNorm -> attention (fused qkv, RoPE) -> RMSNorm -> gated MLP (fused
gate/up). Checkpoint tensors `q_proj/k_proj/v_proj` and `gate_proj/up_proj` are copied
into slices of the fused weights at load time (Phi-3 stores them fused already).
A family's departures from Llama are data, `Style`, carried by the shared layers:
qk-norm, sandwich norms, Gemma's `1 + w` norms and scaled embeddings, the MLP's
activation, a RoPE of its own for sliding layers; soft-capping, sliding windows and
the attention scale come from config.json.

Under tensor parallelism each checkpoint tensor is cut to this rank's share on the
way in (q, k, v by heads, gate and up by columns, o_proj and down_proj by input
columns); under pipeline parallelism the model holds only its stage's layers
(`parallel.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels as c
from bitserve.llm.attention import AttentionMetadata, DecodeBatch
from bitserve.llm.config import layer_types, layer_windows
from bitserve.llm.models.layers import (
    NO_TP,
    SMALL_M,
    Attention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    load_packed,
)
from bitserve.llm.parallel import (
    SINGLE,
    Parallel,
    StageMissing,
    TensorParallel,
    on_other_stage,
)

PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # split along the input dim
ROW_PARALLEL_BIAS = ("o_proj.bias",)  # kept on TP rank 0 only


def c_elementwise(x: torch.Tensor) -> bool:
    """Whether the C elementwise kernels can take x (fp32, CPU, contiguous, no grad)."""
    return (
        x.dtype is torch.float32 and x.is_cpu and x.is_contiguous() and not torch.is_grad_enabled()
    )


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # transformers' GELUTanh
}


C_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}  # the C layer's `act`
FUSED_CHUNK = 512  # rows a C layer call at most (a prompt's rows in chunks)
# a tied LM head up to this size gets its own packed copy of the embedding (tinylm's:
# 4 MiB); a bigger one (a 1B Llama's 1 GiB) stays shared, unpacked
TIED_HEAD_COPY = 64 << 20


class MLP(nn.Module):
    """Gated MLP, act(gate) * up (SwiGLU; Gemma's GeGLU with tanh-GELU); under TP
    `gate_up_proj` is column- and `down_proj` row-parallel."""

    def __init__(
        self, hidden: int, intermediate: int, tp: TensorParallel = NO_TP, activation="silu"
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"MLP activation {activation!r} is not supported (supported: {list(ACTIVATIONS)})"
            )
        self.tp = tp
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.intermediate = intermediate // tp.size
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, hidden, bias=False)

    kernels: c.Kernels | None = None  # silu * up in one pass in C (kernels.attach, at load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and self.act is F.silu and c_elementwise(gate_up):
            return self.tp.all_reduce(self.down_proj(self.kernels.silu_mul(gate_up)))  # one pass
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))


def attention_shape(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads, kv_heads, head_dim


@dataclass(frozen=True)
class Style:
    """How a family's decoder departs from Llama's (the defaults)."""

    qkv_bias: bool = False  # q/k/v biases when config.json has no attention_bias
    o_proj_bias: bool = True  # attention_bias covers o_proj too (Llama); Qwen2: never
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too
    unit_offset_norms: bool = False  # Gemma: RMSNorm weights stored as w - 1
    scaled_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    local_rope: bool = False  # Gemma 3: sliding layers have a RoPE of their own


def activation_of(hf: dict[str, Any]) -> str:
    return hf.get("hidden_activation") or hf.get("hidden_act") or "silu"


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream; with
    `sandwich_norms` (Gemma) each output is normalised again before it is added, and the
    checkpoint's names are Gemma's: `post_attention_layernorm` is then the norm after
    attention, `pre_feedforward_layernorm`/`post_feedforward_layernorm` wrap the MLP."""

    def __init__(self, hf: dict[str, Any], index: int, style: Style, tp: TensorParallel):
        super().__init__()
        self.index = index
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        norm = partial(RMSNorm, eps=eps, unit_offset=style.unit_offset_norms)
        qkv_bias = hf.get("attention_bias", style.qkv_bias)
        scalar = hf.get("query_pre_attn_scalar")
        self.layer_type = layer_types(hf)[index]
        self.self_attn = Attention(
            hidden,
            *attention_shape(hf),
            bias=qkv_bias,
            o_bias=qkv_bias and style.o_proj_bias,
            tp=tp,
            qk_norm=norm if style.qk_norm else None,
            window=layer_windows(hf)[index],
            softcap=hf.get("attn_logit_softcapping"),
            scale=None if scalar is None else scalar**-0.5,
        )
        self.input_layernorm = norm(hidden)
        self.post_attention_layernorm = norm(hidden)
        self.sandwich = style.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden)
            self.post_feedforward_layernorm = norm(hidden)
        self.mlp = self.make_mlp(hf, tp)

    def make_mlp(self, hf: dict[str, Any], tp: TensorParallel) -> nn.Module:
        return MLP(hf["hidden_size"], hf["intermediate_size"], tp, activation_of(hf))

    def forward(self, x, positions, meta: AttentionMetadata, rotary) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, meta, rotary)
        if not self.sandwich:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaForCausalLM(nn.Module):
    """Also Mistral and Qwen2 (the same graph, qkv bias where the config says so), and
    the base of every family module: a subclass sets its `Style` (and `layer_class`)."""

    layer_class = DecoderLayer
    style = Style()

    def __init__(self, hf: dict[str, Any], max_model_len: int, parallel: Parallel = SINGLE):
        super().__init__()
        self.hf = hf
        self.parallel = parallel
        style = self.style
        hidden, vocab = hf["hidden_size"], hf["vocab_size"]
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        first, last = parallel.is_first_stage, parallel.is_last_stage
        # the last stage holds the embedding too when the LM head is tied to it
        has_embedding = first or (last and self.tie_word_embeddings)
        self.embed_tokens = nn.Embedding(vocab, hidden) if has_embedding else None
        self.embed_scale = hidden**0.5 if style.scaled_embeddings else None
        self.stage = parallel.layers(hf["num_hidden_layers"])
        self.layers = nn.ModuleList(
            self.layer_class(hf, i, style, parallel.tp) if i in self.stage else StageMissing()
            for i in range(hf["num_hidden_layers"])
        )
        eps = hf.get("rms_norm_eps", 1e-6)
        self.norm = RMSNorm(hidden, eps, style.unit_offset_norms) if last else None
        self.lm_head = Linear(hidden, vocab, bias=False) if last else None
        self.final_softcap = hf.get("final_logit_softcapping")
        self.tie_weights()
        _, _, head_dim = attention_shape(hf)
        self.rotary = RotaryEmbedding(hf, head_dim, max_model_len, "full_attention")
        self.local_rotary = None
        if style.local_rope:
            self.local_rotary = RotaryEmbedding(hf, head_dim, max_model_len, "sliding_attention")

    def tie_weights(self) -> None:
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.packed = False  # (a packed copy, if there was one, is dropped)

    def pack_tied_head(self) -> None:
        """With the C kernels, a tied LM head of at most TIED_HEAD_COPY bytes reads its
        own packed copy of the embedding (which keeps its rows for the lookup): the packed
        GEMM reads the weight once for all rows (a speculative step's 5 rows of tinylm:
        0.10 ms, unpacked 0.17) and gives each row the same bits whatever rows share its
        call (the unpacked kernel does not), so a decode row scores alike alone and in a
        verification chunk. Both paths read the same head."""
        head, embed = self.lm_head, self.embed_tokens
        if type(head) is not Linear or type(embed) is not nn.Embedding or head.kernels is None:
            return  # (a quantized head reads the quantized embedding)
        weight = embed.weight
        if head.weight is not weight or weight.dtype is not torch.float32:
            return
        if weight.numel() * weight.element_size() > TIED_HEAD_COPY or weight.shape[0] % 16:
            return
        head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        head.pack()
        if not head.packed:  # (not on this device): shared again
            self.tie_weights()

    @property
    def local_layers(self) -> list[DecoderLayer]:
        """The layers of this pipeline stage (all of them without pipeline parallelism).
        Read on every decode step: one slice, not an index per layer (~1 us, not ~9)."""
        return list(self.layers)[self.stage.start : self.stage.stop]

    @property
    def attentions(self) -> list[Attention]:
        return [layer.self_attn for layer in self.local_layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata, hidden=None) -> torch.Tensor:
        """`hidden`: the previous stage's output (pipeline parallelism), else None."""
        x = self.embed(input_ids) if hidden is None else hidden
        rope_positions = self.rotary.table_positions(positions, meta)
        if self.can_fuse_decode(x, meta):
            return self.final_norm(self.fused_decode(x, rope_positions, meta))
        local = self.local_rotary
        local_positions = local.table_positions(positions, meta) if local is not None else None
        for layer in self.local_layers:
            if local is not None and layer.layer_type == "sliding_attention":
                x = layer(x, local_positions, meta, local)
            else:
                x = layer(x, rope_positions, meta, self.rotary)
        return self.final_norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        # rounded to x's dtype as transformers does; a CPU scalar, no copy to x's device
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.norm is not None else x

    # -- small decode steps: one C call per layer (bitserve/kernels) -------------------
    _kernels: c.Kernels | None = None
    fuse_rows = 0  # up to this many decode rows a step runs one C call per layer

    @property
    def kernels(self) -> c.Kernels | None:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: c.Kernels | None) -> None:
        """Set once, when the model is loaded (kernels.attach); with the kernels it also
        decides whether decode steps run one C call per layer, and up to how many rows."""
        self._kernels = kernels
        if kernels is not None:
            self.pack_tied_head()
        self.fuse_rows = self.fused_rows() if kernels is not None else 0

    lora = None  # the LoRA adapters' manager (llm/lora.py), when the engine serves them

    def can_fuse_decode(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Every row is a one-token decode and the C layer suits the row count; rows with
        a LoRA adapter only when the C layer adds its deltas (lora.py's "c" path)."""
        return (
            self.fuses(x.shape[0])
            and meta.decode is not None
            and not meta.seqs
            and x.dtype is torch.float32
            and not torch.is_grad_enabled()
        )

    def fuses(self, rows: int) -> bool:
        """Whether a batched step (every row's attention through the paged decode) of
        `rows` rows runs the C layer: what can_fuse_decode knows before the step."""
        return rows <= self.fuse_rows and (self.lora is None or self.lora.fuses())

    def fused_rows(self) -> int:
        """Up to how many rows the C decode layer runs (0: never), the fewest any of its
        linear layers suits (fp32: few rows, or any for small weights; int8 and int4
        their own). The C layer reads every linear through a `Weight` (fp32, int8 or
        int4), a gated MLP (SiLU or tanh-GELU), full-width RoPE, and no TP (the
        all-reduces sit inside the layer). It carries every Style: qk-norm, sandwich
        norms (Gemma's `1 + w` multipliers are computed for it), windows, soft-capping,
        a second RoPE table; not longrope on local layers (one table row per position)."""
        _, _, head_dim = attention_shape(self.hf)
        if self.parallel.tp.size != 1 or self.rotary.cos.shape[-1] != head_dim:
            return 0
        local = self.local_rotary
        if local is not None and (local.cos.shape[-1] != head_dim or local.kind == "longrope"):
            return 0
        rows = []
        for layer in self.local_layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP or mlp.activation not in C_ACTIVATIONS:
                return 0
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if getattr(linear, "c_view", None) is None or linear.c_view() is None:
                    return 0
                rows.append(linear.fuse_rows)
        return min(rows, default=0)

    def layer_params(self) -> list:
        """The C view of every layer (`LayerParams`), rebuilt when a pool or table changes.

        The key holds the pool tuples and the RoPE tables themselves (compared by
        identity), so nothing the pointers refer to can be freed while they are cached;
        `_c_tensors` keeps the norm multipliers computed for the C layer (Gemma's 1 + w).
        """
        tables = [self.rotary] + ([self.local_rotary] if self.local_rotary is not None else [])
        key = (
            *(t for rotary in tables for t in (rotary.cos, rotary.sin)),
            *(attn.kv_cache for attn in self.attentions),
        )
        old = getattr(self, "_params_key", ())
        if len(old) != len(key) or any(a is not b for a, b in zip(old, key, strict=True)):
            self._c_tensors: list[torch.Tensor] = []
            self._params = [self.c_params(layer) for layer in self.local_layers]
            self._params_key = key
        return self._params

    def c_norm(self, norm: RMSNorm | None) -> torch.Tensor | None:
        """The multiplier the C layer reads for `norm` (kept alive with the params)."""
        if norm is None:
            return None
        scale = norm.scale().contiguous()
        self._c_tensors.append(scale)
        return scale

    def c_params(self, layer: DecoderLayer):
        attn, mlp = layer.self_attn, layer.mlp
        k_pool, v_pool = attn.kv_cache
        rotary = self.rotary
        if self.local_rotary is not None and layer.layer_type == "sliding_attention":
            rotary = self.local_rotary
        sandwich = layer.sandwich
        pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        lora = self.lora.c_view if self.lora is not None else lambda _: None
        return c.layer_params(
            qkv=attn.qkv_proj.c_view(lora(attn.qkv_proj)),
            o=attn.o_proj.c_view(lora(attn.o_proj)),
            gu=mlp.gate_up_proj.c_view(lora(mlp.gate_up_proj)),
            down=mlp.down_proj.c_view(lora(mlp.down_proj)),
            ln1=self.c_norm(layer.input_layernorm),
            ln2=self.c_norm(pre_mlp),
            qnorm=self.c_norm(attn.q_norm),
            knorm=self.c_norm(attn.k_norm),
            post_attn=self.c_norm(layer.post_attention_layernorm if sandwich else None),
            post_mlp=self.c_norm(layer.post_feedforward_layernorm if sandwich else None),
            kpool=k_pool,
            vpool=v_pool,
            cos=rotary.cos,
            sin=rotary.sin,
            H=layer.input_layernorm.weight.shape[0],
            Hq=attn.num_heads,
            Hkv=attn.num_kv_heads,
            D=attn.head_dim,
            I=mlp.intermediate,
            nblk=k_pool.shape[1],
            bs=k_pool.shape[2],
            window=attn.window or 0,
            act=C_ACTIVATIONS[mlp.activation],
            eps=layer.input_layernorm.eps,
            scale=attn.scale,
            softcap=attn.softcap or 0.0,
        )

    def fused_decode(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Every layer as one C call per chunk of up to FUSED_CHUNK rows (prompt rows
        too: a row needs only the K/V of its own sequence's earlier rows, which an earlier
        chunk or its own wrote), so the scratch stays bounded."""
        layer = self.layers[self.stage.start]
        attn = layer.self_attn
        per_row = 2 * self.hf["hidden_size"] + 2 * (attn.q_size + attn.kv_size)
        per_row += 3 * layer.mlp.intermediate
        rows = min(x.shape[0], FUSED_CHUNK)
        scratch = getattr(self, "_scratch", None)
        if scratch is None or scratch.numel() < per_row * rows:
            scratch = self._scratch = torch.empty(per_row * max(SMALL_M, rows))
        x = x.contiguous()
        d, slots, chunks = meta.decode, meta.slot_mapping, []
        for a in range(0, len(x), FUSED_CHUNK):  # d.rows is 0 .. T - 1: every row, in order
            b = min(a + FUSED_CHUNK, len(x))
            tables, lens, ends = d.block_tables[a:b], d.context_lens[a:b], d.seq_lens[a:b]
            batch = DecodeBatch(d.rows[: b - a], tables, lens, ends)
            chunks.append((a, x[a:b], positions[a:b], slots[a:b], batch))
        lora = self.lora if self.lora is not None and len(chunks) > 1 else None
        for params in self.layer_params():
            for a, rows_x, rows_pos, rows_slots, rows_d in chunks:
                if lora is not None:  # the C layer reads the chunk's adapters from row 0
                    lora.chunk(a, len(rows_x))
                self.kernels.decode_layer(params, rows_x, rows_pos, rows_slots, rows_d, scratch)
        return x

    def fused_stepper(self, input_ids, positions, meta: AttentionMetadata):
        """Speculative decoding's draft loop (ModelRunner.decode_steps): a forward over
        step buffers that stay put from step to step (the loop rewrites their values),
        as `fused_decode` computes it, with every pointer cast once for all steps
        instead of eight per layer and step. A callable returning the final hidden
        states, or None where fused_decode would not run (the caller calls forward)."""
        if self.stage.start != 0 or self.norm is None or len(input_ids) > FUSED_CHUNK:
            return None
        d = meta.decode
        # the same step buffers as the last call's (the runner's, reused from step to
        # step): its stepper again, not a new cast of every pointer (~40 us)
        key = None
        if d is not None and not meta.seqs:
            views = (input_ids, positions, meta.slot_mapping, d.rows, d.block_tables)
            key = (*(t.data_ptr() for t in views), len(input_ids), d.block_tables.shape[1])
            key += (d.context_lens.data_ptr(), id(self.layer_params()), self.lora is None)
            cached = getattr(self, "_stepper", None)
            if cached is not None and cached[0] == key:
                return cached[1]
        x = self.embed(input_ids).contiguous()
        if not self.can_fuse_decode(x, meta) or meta.decode is None:
            return None
        if self.rotary.table_positions(positions, meta) is not positions:
            return None
        layer = self.layers[0]
        attn = layer.self_attn
        per_row = 2 * self.hf["hidden_size"] + 2 * (attn.q_size + attn.kv_size)
        per_row += 3 * layer.mlp.intermediate
        scratch = torch.empty(per_row * len(x))
        embed = self.embed_tokens
        weight = embed.weight if type(embed) is nn.Embedding else None  # else: its forward
        plain = self.embed_scale is None and weight is not None and weight.dtype == x.dtype
        # fp32 (numpy takes no bf16): the embedding and the final RMSNorm in numpy on the
        # stepper's own buffers (~0.5 us an op where torch's is ~3), the same IEEE ops
        # as Int8Embedding/RMSNorm.forward (same bits, tested), torch's mean kept (numpy
        # sums in another order); no tensor allocated per step
        fp32 = x.dtype is torch.float32
        qweight = getattr(embed, "qweight", None) if self.embed_scale is None else None
        int8 = fp32 and qweight is not None and getattr(embed, "dtype", None) == x.dtype
        norm = self.norm
        host_norm = fp32 and type(norm) is RMSNorm and not norm.unit_offset
        if fp32:
            n_x, n_ids = x.numpy(), input_ids.numpy()
        if plain and fp32:
            n_weight = weight.detach().numpy()
        if int8:  # Int8Embedding: rows * scales
            n_qweight, n_scales = qweight.numpy(), embed.scales.numpy()
            n_q = np.empty(x.shape, dtype=n_qweight.dtype)
            n_s = np.empty(len(x), dtype=np.float32)
        if host_norm:
            square, mean, y = torch.empty_like(x), torch.empty(len(x), 1), torch.empty_like(x)
            n_square, n_mean, n_y = square.numpy(), mean.numpy(), y.numpy()
            n_w, eps = norm.weight.detach().numpy(), np.float32(norm.eps)
        params, lib = self.layer_params(), self.kernels.lib
        args = c.decode_args(x, positions, meta.slot_mapping, meta.decode, scratch)
        keep = (x, scratch, positions, meta)  # what the pointers point into

        def step() -> torch.Tensor:
            if plain and fp32:
                np.take(n_weight, n_ids, axis=0, out=n_x)
            elif plain:
                torch.index_select(weight, 0, input_ids, out=x)
            elif int8:
                np.take(n_qweight, n_ids, axis=0, out=n_q)
                np.take(n_scales, n_ids, out=n_s)
                np.multiply(n_q, n_s[:, None], out=n_x)
            else:  # Gemma's scale, a bf16 int8 embedding
                x.copy_(self.embed(input_ids))
            for p in params:
                lib.bs_decode_layer(p, *args)
            if not host_norm:
                return norm(keep[0])
            # x * rsqrt(mean(x^2) + eps) * weight, RMSNorm.forward's ops in its order
            np.multiply(n_x, n_x, out=n_square)
            torch.mean(square, -1, keepdim=True, out=mean)
            np.add(n_mean, eps, out=n_mean)
            np.reciprocal(np.sqrt(n_mean, out=n_mean), out=n_mean)
            np.multiply(n_x, n_mean, out=n_y)
            np.multiply(n_w, n_y, out=n_y)
            return y

        self._stepper = (key, step)  # (its closure keeps what the pointers point into)
        return step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:  # Gemma 2, in transformers' order, in place
            logits = logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def parameter_for(self, name: str) -> tuple[str, int | None]:
        """Map a checkpoint name to (our parameter name, shard of a fused weight or None)."""
        name = name.removeprefix("model.")
        for part, (fused, shard) in PACKED.items():
            if f".{part}." in name:
                return name.replace(part, fused), shard
        return name, None

    def elsewhere(self, target: str) -> bool:
        """Whether a parameter lives on another pipeline stage (so it is not loaded here)."""
        return on_other_stage(target, self.stage, self.parallel.pp_size)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor):
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return
        target, shard = self.parameter_for(name)
        if target not in params:
            if self.elsewhere(target):
                return
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        param, tp = params[target], self.parallel.tp
        if shard is None and target.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            # a checkpoint that stores them fused (Phi-3): cut into parts, load each
            sizes = self.packed_sizes(target)
            for i, part in enumerate(tensor.split(sizes)):
                load_packed(param, tp.shard(part, 0), i, [size // tp.size for size in sizes])
            return
        if shard is None:
            if target.endswith(ROW_PARALLEL):
                tensor = tp.shard(tensor, 1)
            elif target.endswith(ROW_PARALLEL_BIAS):
                tensor = tp.row_bias(tensor)
            param.data.copy_(tensor)
            return
        sizes = self.packed_sizes(target)
        # column-parallel: this rank's heads of q, k or v; its columns of gate or up
        load_packed(param, tp.shard(tensor, 0), shard, [size // tp.size for size in sizes])

    def packed_sizes(self, target: str) -> list[int]:
        """The full (unsharded) sizes of the parts of a fused weight: q, k, v or gate, up."""
        heads, kv_heads, head_dim = attention_shape(self.hf)
        if "qkv_proj" in target:
            return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        return [self.hf["intermediate_size"]] * 2


class Qwen2ForCausalLM(LlamaForCausalLM):
    style = Style(qkv_bias=True, o_proj_bias=False)  # q/k/v biases, never an o_proj bias


class MistralForCausalLM(LlamaForCausalLM):
    pass
