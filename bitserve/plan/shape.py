"""A model's shape read from its `config.json`: the numbers every estimate starts from.

Parameter counts come from the architecture's formula, not from the weights, so that a
config alone (no download) is enough to plan, and so that the memory check compares two
independent numbers: this formula against the tensors the engine really builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    family: str  # "llama" (also mistral, qwen2, mixtral) or "gpt2"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    experts: int = 1  # MoE: experts per layer; 1 for a dense MLP
    experts_per_token: int = 1
    expert_intermediate: int = 0  # Qwen-MoE's moe_intermediate_size (0: intermediate)
    dense_layers: int = 0  # MoE models: layers with a dense MLP instead of experts
    layer_norm_params: int = 0  # per layer beyond two RMSNorms (qk-norm, sandwich norms)
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes: the paged cache's unit."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def layer_matrix_params(self, active_only: bool = False) -> int:
        """Weights of the decoder layers' linear maps: what int8/int4 quantization shrinks.
        With `active_only`, an MoE layer counts only the experts a token goes through."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        if self.family == "gpt2":
            return self.layers * (attention + 2 * self.hidden * self.intermediate)
        experts = self.experts_per_token if active_only else self.experts
        if self.experts == 1:
            return self.layers * (attention + 3 * self.hidden * self.intermediate)
        inter = self.expert_intermediate or self.intermediate
        sparse = experts * 3 * self.hidden * inter + self.hidden * self.experts  # + router
        dense = 3 * self.hidden * self.intermediate
        moe_layers = self.layers - self.dense_layers
        return self.layers * attention + moe_layers * sparse + self.dense_layers * dense

    def other_params(self) -> int:
        """Embeddings, LM head, norms, biases: kept in the model dtype when quantizing."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.family == "gpt2":  # wte (tied head), wpe, 2 LayerNorms + biases per layer
            biases = (q + 2 * kv) + h + self.intermediate + h
            return self.vocab * h + self.max_positions * h + self.layers * (4 * h + biases) + 2 * h
        embeddings = self.vocab * h * (1 if self.tied_embeddings else 2)
        biases = ((q + 2 * kv) if self.qkv_bias else 0) + (h if self.o_bias else 0)
        return embeddings + self.layers * (2 * h + biases + self.layer_norm_params) + h

    def params(self) -> int:
        return self.layer_matrix_params() + self.other_params()

    def flops_per_token(self) -> int:
        """Forward FLOPs per token, ignoring attention over the context: 2 x active weights
        (each weight is one multiply and one add). The LM head counts; embeddings do not."""
        head = self.vocab * self.hidden
        return 2 * (self.layer_matrix_params(active_only=True) + head)


def read_config(model: Path) -> dict[str, Any]:
    """`model` is a model folder or a config.json file."""
    path = model / "config.json" if model.is_dir() else model
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    return json.loads(path.read_text())


def dense_moe_layers(hf: dict[str, Any]) -> int:
    """Qwen-MoE's layers without experts (`mlp_only_layers`, `decoder_sparse_step`)."""
    if not (hf.get("num_experts") or hf.get("num_local_experts")):
        return 0
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    return sum(1 for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step)


def extra_norm_params(hf: dict[str, Any]) -> int:
    """Norm weights per layer beyond Llama's two: qk-norm (Qwen3, Gemma 3) and Gemma's
    norms after attention and the MLP."""
    kind = hf.get("model_type", "")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    qk = 2 * head_dim if kind in ("qwen3", "qwen3_moe", "gemma3_text") else 0
    sandwich = 2 * hf["hidden_size"] if kind in ("gemma2", "gemma3_text") else 0
    return qk + sandwich


def from_config(hf: dict[str, Any]) -> ModelShape:
    """The shape of a Llama-family (Llama, Mistral, Qwen2, Mixtral) or GPT-2 config."""
    arch = (hf.get("architectures") or [""])[0]
    if arch == "GPT2LMHeadModel" or hf.get("model_type") == "gpt2":
        hidden, heads = hf["n_embd"], hf["n_head"]
        return ModelShape(
            "gpt2", hf["n_layer"], hidden, heads, heads, hidden // heads,
            hf.get("n_inner") or 4 * hidden, hf["vocab_size"], hf["n_positions"],
            tied_embeddings=True, qkv_bias=True, o_bias=True,
        )  # fmt: skip
    heads = hf["num_attention_heads"]
    qwen2 = arch == "Qwen2ForCausalLM" or hf.get("model_type") == "qwen2"
    bias = bool(hf.get("attention_bias", qwen2))  # Llama's covers o_proj; Qwen2's does not
    return ModelShape(
        family="llama",
        layers=hf["num_hidden_layers"],
        hidden=hf["hidden_size"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        max_positions=hf.get("max_position_embeddings", 4096),
        experts=hf.get("num_local_experts") or hf.get("num_experts") or 1,
        experts_per_token=hf.get("num_experts_per_tok", 1),
        expert_intermediate=hf.get("moe_intermediate_size") or 0,
        dense_layers=dense_moe_layers(hf),
        layer_norm_params=extra_norm_params(hf),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias and not qwen2,
    )
