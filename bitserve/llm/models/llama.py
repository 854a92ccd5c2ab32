"""The Llama family: Llama 2/3 (GQA, rope scaling), Mistral, Qwen2 (qkv bias, tied embeddings).

One decoder: RMSNorm -> attention (fused qkv, RoPE) -> RMSNorm -> SwiGLU MLP (fused
gate/up). Checkpoint tensors `q_proj/k_proj/v_proj` and `gate_proj/up_proj` are copied
into slices of the fused weights at load time.

Under tensor parallelism each checkpoint tensor is cut to this rank's share on the
way in (q, k, v by heads, gate and up by columns, o_proj and down_proj by input
columns); under pipeline parallelism the model holds only its stage's layers
(`parallel.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitserve.llm import kernels
from bitserve.llm.attention import AttentionMetadata
from bitserve.llm.models.layers import (
    NO_TP,
    SMALL_M,
    Attention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    load_packed,
    use_kernel,
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


class MLP(nn.Module):
    """SwiGLU; under TP `gate_up_proj` is column- and `down_proj` row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        self.intermediate = intermediate // tp.size
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if c_elementwise(gate_up) and (k := kernels.get()) is not None:
            return self.tp.all_reduce(self.down_proj(k.silu_mul(gate_up)))  # one pass
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


def attention_shape(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads, kv_heads, head_dim


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict[str, Any], qkv_bias: bool, o_bias: bool, tp: TensorParallel):
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(
            hidden, *attention_shape(hf), bias=qkv_bias, o_bias=o_bias, tp=tp
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = self.make_mlp(hf, tp)

    def make_mlp(self, hf: dict[str, Any], tp: TensorParallel) -> nn.Module:
        return MLP(hf["hidden_size"], hf["intermediate_size"], tp)

    def forward(self, x, positions, meta: AttentionMetadata, rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Also Mistral and Qwen2: the same graph, with qkv bias where the config says so."""

    layer_class = DecoderLayer
    qkv_bias = False  # default when config.json has no attention_bias
    o_proj_bias = True  # Llama's attention_bias covers o_proj too

    def __init__(self, hf: dict[str, Any], max_model_len: int, parallel: Parallel = SINGLE):
        super().__init__()
        self.hf = hf
        self.parallel = parallel
        qkv_bias = hf.get("attention_bias", self.qkv_bias)
        o_bias = qkv_bias and self.o_proj_bias
        hidden, vocab = hf["hidden_size"], hf["vocab_size"]
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        first, last = parallel.is_first_stage, parallel.is_last_stage
        # the last stage holds the embedding too when the LM head is tied to it
        has_embedding = first or (last and self.tie_word_embeddings)
        self.embed_tokens = nn.Embedding(vocab, hidden) if has_embedding else None
        self.stage = parallel.layers(hf["num_hidden_layers"])
        self.layers = nn.ModuleList(
            self.layer_class(hf, qkv_bias, o_bias, parallel.tp)
            if i in self.stage
            else StageMissing()
            for i in range(hf["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, hf.get("rms_norm_eps", 1e-6)) if last else None
        self.lm_head = Linear(hidden, vocab, bias=False) if last else None
        self.tie_weights()
        _, _, head_dim = attention_shape(hf)
        self.rotary = RotaryEmbedding(hf, head_dim, max_model_len)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

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
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if self.can_fuse_decode(x, meta):
            x = self.fused_decode(x, positions, meta)
        else:
            for layer in self.local_layers:
                x = layer(x, positions, meta, self.rotary)
        return self.norm(x) if self.norm is not None else x

    # -- small decode steps: one C call per layer (kernels.py) --------------------------
    def can_fuse_decode(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Every row is a one-token decode, the C kernel suits the row count (few rows,
        or a small model: layers.use_kernel), and the model is a plain fp32 Llama (no
        MoE, full-width RoPE) on the CPU with the kernels built."""
        return (
            meta.decode is not None
            and not meta.seqs
            and use_kernel(x.shape[0], self.hf["hidden_size"], 2 * self.hf["intermediate_size"])
            and x.dtype is torch.float32
            and x.is_cpu
            and not torch.is_grad_enabled()
            and self.parallel.tp.size == 1  # the all-reduces sit inside the layer
            and self.fusable()
            and kernels.get() is not None
        )

    def fusable(self) -> bool:
        """The C layer reads fp32 `Linear` weights: a plain MLP, full-width RoPE, and no
        layer swapped for another kind (quantized layers are, after the model is built)."""
        _, _, head_dim = attention_shape(self.hf)
        if self.rotary.cos.shape[-1] != head_dim:
            return False
        for layer in self.local_layers:  # every decode step: each submodule looked up once
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP:
                return False
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(type(linear) is Linear for linear in linears):
                return False
        return True

    def layer_params(self) -> list[kernels.LayerParams]:
        """The C view of every layer (raw pointers), rebuilt when a pool or table changes.

        The key holds the pool tuples and the RoPE tables themselves (compared by
        identity), so nothing the pointers refer to can be freed while they are cached.
        """
        key = (
            self.rotary.cos,
            self.rotary.sin,
            *(attn.kv_cache for attn in self.attentions),
        )
        old = getattr(self, "_params_key", ())
        if len(old) != len(key) or any(a is not b for a, b in zip(old, key, strict=True)):
            self._params = [self.c_params(layer) for layer in self.local_layers]
            self._params_key = key
        return self._params

    def c_params(self, layer: DecoderLayer) -> kernels.LayerParams:
        attn, mlp, ptr = layer.self_attn, layer.mlp, kernels.ptr
        k_pool, v_pool = attn.kv_cache
        return kernels.LayerParams(
            ln1=ptr(layer.input_layernorm.weight),
            wqkv=ptr(attn.qkv_proj.weight),
            bqkv=ptr(attn.qkv_proj.bias),
            wo=ptr(attn.o_proj.weight),
            bo=ptr(attn.o_proj.bias),
            ln2=ptr(layer.post_attention_layernorm.weight),
            wgu=ptr(mlp.gate_up_proj.weight),
            wdown=ptr(mlp.down_proj.weight),
            kpool=ptr(k_pool),
            vpool=ptr(v_pool),
            cos=ptr(self.rotary.cos),
            sin=ptr(self.rotary.sin),
            **kernels.layer_shape(layer),
        )

    def fused_decode(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        k = kernels.get()
        layer = self.layers[self.stage.start]
        attn = layer.self_attn
        per_row = 2 * self.hf["hidden_size"] + 2 * (attn.q_size + attn.kv_size)
        per_row += 3 * layer.mlp.intermediate
        scratch = getattr(self, "_scratch", None)
        if scratch is None or scratch.numel() < per_row * x.shape[0]:
            scratch = self._scratch = torch.empty(per_row * max(SMALL_M, x.shape[0]))
        x = x.contiguous()
        for params in self.layer_params():
            k.llama_decode_layer(params, x, positions, meta.slot_mapping, meta.decode, scratch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

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
        if shard is None:
            if target.endswith(ROW_PARALLEL):
                tensor = tp.shard(tensor, 1)
            elif target.endswith(ROW_PARALLEL_BIAS):
                tensor = tp.row_bias(tensor)
            param.data.copy_(tensor)
            return
        heads, kv_heads, head_dim = attention_shape(self.hf)
        if "qkv_proj" in target:
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        else:
            sizes = [self.hf["intermediate_size"]] * 2
        # column-parallel: this rank's heads of q, k or v; its columns of gate or up
        load_packed(param, tp.shard(tensor, 0), shard, [size // tp.size for size in sizes])


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, never an o_proj bias
    o_proj_bias = False


class MistralForCausalLM(LlamaForCausalLM):
    pass
