"""Qwen3-MoE: Qwen3's attention (qk-norm) with Mixtral's sparse MoE layers (top-k
weights renormalised only with `norm_topk_prob`), a dense SwiGLU MLP in the layers
`mlp_only_layers` names or that `decoder_sparse_step` skips."""

from __future__ import annotations

from typing import Any

from torch import nn

from bitserve.llm.models.llama import MLP, DecoderLayer, Style
from bitserve.llm.models.mixtral import MixtralForCausalLM, SparseMoE, num_experts
from bitserve.llm.parallel import TensorParallel


def is_sparse(hf: dict[str, Any], index: int) -> bool:
    """transformers' rule for which layers have experts."""
    step = hf.get("decoder_sparse_step", 1)
    only_mlp = index in (hf.get("mlp_only_layers") or [])
    return not only_mlp and num_experts(hf) > 0 and (index + 1) % step == 0


class Qwen3MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, hf: dict[str, Any], tp: TensorParallel) -> nn.Module:
        if is_sparse(hf, self.index):
            return SparseMoE(hf, tp)
        return MLP(hf["hidden_size"], hf["intermediate_size"], tp)


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    style = Style(qk_norm=True)
