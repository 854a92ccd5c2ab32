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

from bitserve.llm.attention import AttentionMetadata
from bitserve.llm.models.layers import Attention, RMSNorm, RotaryEmbedding, load_packed

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
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

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
        self.lm_head = nn.Linear(hf["hidden_size"], hf["vocab_size"], bias=False)
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
        for layer in self.layers:
            x = layer(x, positions, meta, self.rotary)
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
