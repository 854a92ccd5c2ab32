"""GPT-2: learned positions, LayerNorm, fused c_attn with bias, tanh-GELU, tied lm_head.

GPT-2's checkpoints store `Conv1D` weights as [in, out]; they are transposed into
`nn.Linear`'s [out, in] at load time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bitserve.llm.attention import AttentionMetadata
from bitserve.llm.models.layers import Attention

CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden, inner)
        self.c_proj = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu_new(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hf: dict[str, Any]):
        super().__init__()
        hidden, heads, eps = hf["n_embd"], hf["n_head"], hf.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads, heads, hidden // heads, bias=True, o_bias=True)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(hidden, hf.get("n_inner") or 4 * hidden)

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), positions, meta, None)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, hf: dict[str, Any], max_model_len: int):
        super().__init__()
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {act!r} is not supported (gelu_new only)")
        self.wte = nn.Embedding(hf["vocab_size"], hf["n_embd"])
        self.wpe = nn.Embedding(hf["n_positions"], hf["n_embd"])
        self.h = nn.ModuleList(GPT2Block(hf) for _ in range(hf["n_layer"]))
        self.ln_f = nn.LayerNorm(hf["n_embd"], eps=hf.get("layer_norm_epsilon", 1e-5))

    @property
    def attentions(self) -> list[Attention]:
        return [block.attn for block in self.h]

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, positions, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.wte.weight)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor):
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith(".attn.bias") or "masked_bias" in name:
            return  # tied to wte / causal-mask buffers of old checkpoints
        if name.endswith(CONV1D):
            tensor = tensor.t()
        name = name.replace("attn.c_attn", "attn.qkv_proj").replace("attn.c_proj", "attn.o_proj")
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in GPT2LMHeadModel")
        params[name].data.copy_(tensor)
