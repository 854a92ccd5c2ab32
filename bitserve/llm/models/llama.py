"""The Llama family: Llama 2/3 (GQA, rope scaling), Mistral, Qwen2 (qkv bias, tied embeddings).

One decoder: RMSNorm -> attention (fused qkv, RoPE) -> RMSNorm -> SwiGLU MLP (fused
gate/up). Checkpoint tensors `q_proj/k_proj/v_proj` and `gate_proj/up_proj` are copied
into slices of the fused weights at load time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitserve.llm import kernels
from bitserve.llm.attention import AttentionMetadata
from bitserve.llm.models.layers import (
    SMALL_M,
    Attention,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    load_packed,
    use_kernel,
)

PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def attention_shape(hf: dict[str, Any]) -> tuple[int, int, int]:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return heads, kv_heads, head_dim


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict[str, Any], qkv_bias: bool, o_bias: bool):
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(hidden, *attention_shape(hf), bias=qkv_bias, o_bias=o_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = self.make_mlp(hf)

    def make_mlp(self, hf: dict[str, Any]) -> nn.Module:
        return MLP(hf["hidden_size"], hf["intermediate_size"])

    def forward(self, x, positions, meta: AttentionMetadata, rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Also Mistral and Qwen2: the same graph, with qkv bias where the config says so."""

    layer_class = DecoderLayer
    qkv_bias = False  # default when config.json has no attention_bias
    o_proj_bias = True  # Llama's attention_bias covers o_proj too

    def __init__(self, hf: dict[str, Any], max_model_len: int):
        super().__init__()
        self.hf = hf
        qkv_bias = hf.get("attention_bias", self.qkv_bias)
        o_bias = qkv_bias and self.o_proj_bias
        self.embed_tokens = nn.Embedding(hf["vocab_size"], hf["hidden_size"])
        self.layers = nn.ModuleList(
            self.layer_class(hf, qkv_bias, o_bias) for _ in range(hf["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = Linear(hf["hidden_size"], hf["vocab_size"], bias=False)
        self.tie_weights()
        _, _, head_dim = attention_shape(hf)
        self.rotary = RotaryEmbedding(hf, head_dim, max_model_len)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attentions(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.can_fuse_decode(x, meta):
            return self.fused_decode(x, positions, meta)
        for layer in self.layers:
            x = layer(x, positions, meta, self.rotary)
        return self.norm(x)

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
            and self.fusable()
            and kernels.get() is not None
        )

    def fusable(self) -> bool:
        if not hasattr(self, "_fusable"):
            _, _, head_dim = attention_shape(self.hf)
            self._fusable = (
                all(type(layer.mlp) is MLP for layer in self.layers)
                and self.rotary.cos.shape[-1] == head_dim
            )
        return self._fusable

    def layer_params(self) -> list[kernels.LayerParams]:
        """The C view of every layer (raw pointers), rebuilt when a pool or table changes.

        The key holds the pool tuples and the RoPE tables themselves (compared by
        identity), so nothing the pointers refer to can be freed while they are cached.
        """
        key = (
            self.rotary.cos,
            self.rotary.sin,
            *(layer.self_attn.kv_cache for layer in self.layers),
        )
        old = getattr(self, "_params_key", ())
        if len(old) != len(key) or any(a is not b for a, b in zip(old, key, strict=True)):
            self._params = [self.c_params(layer) for layer in self.layers]
            self._params_key = key
        return self._params

    def c_params(self, layer: DecoderLayer) -> kernels.LayerParams:
        attn, mlp = layer.self_attn, layer.mlp
        k_pool, v_pool = attn.kv_cache

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

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
            H=self.hf["hidden_size"],
            Hq=attn.num_heads,
            Hkv=attn.num_kv_heads,
            D=attn.head_dim,
            I=mlp.intermediate,
            nblk=k_pool.shape[1],
            bs=k_pool.shape[2],
            eps=layer.input_layernorm.eps,
            scale=attn.scale,
        )

    def fused_decode(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        k = kernels.get()
        attn = self.layers[0].self_attn
        per_row = 2 * self.hf["hidden_size"] + 2 * (attn.q_size + attn.kv_size)
        per_row += 3 * self.layers[0].mlp.intermediate
        scratch = getattr(self, "_scratch", None)
        if scratch is None or scratch.numel() < per_row * x.shape[0]:
            scratch = self._scratch = torch.empty(per_row * max(SMALL_M, x.shape[0]))
        x = x.contiguous()
        for params in self.layer_params():
            k.llama_decode_layer(params, x, positions, meta.slot_mapping, meta.decode, scratch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def parameter_for(self, name: str) -> tuple[str, int | None]:
        """Map a checkpoint name to (our parameter name, shard of a fused weight or None)."""
        name = name.removeprefix("model.")
        for part, (fused, shard) in PACKED.items():
            if f".{part}." in name:
                return name.replace(part, fused), shard
        return name, None

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor):
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return
        target, shard = self.parameter_for(name)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        param = params[target]
        if shard is None:
            param.data.copy_(tensor)
            return
        heads, kv_heads, head_dim = attention_shape(self.hf)
        if "qkv_proj" in target:
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        else:
            sizes = [self.hf["intermediate_size"]] * 2
        load_packed(param, tensor, shard, sizes)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, never an o_proj bias
    o_proj_bias = False


class MistralForCausalLM(LlamaForCausalLM):
    pass
