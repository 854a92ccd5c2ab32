"""GPT-2: learned positions, LayerNorm, fused c_attn with bias, tanh-GELU, tied lm_head.

GPT-2's checkpoints store `Conv1D` weights as [in, out]; they are transposed into
`nn.Linear`'s [out, in] at load time. Under tensor parallelism the fused `c_attn`
is cut per part (this rank's q, k and v heads), `c_fc` by output columns, both
`c_proj` by input columns (their biases on TP rank 0 only); see parallel.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bitserve.llm.attention import AttentionMetadata
from bitserve.llm.models.layers import NO_TP, Attention
from bitserve.llm.parallel import (
    SINGLE,
    Parallel,
    StageMissing,
    TensorParallel,
    on_other_stage,
)

CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        self.c_fc = nn.Linear(hidden, inner // tp.size)
        self.c_proj = nn.Linear(inner // tp.size, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.c_proj(gelu_new(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, hf: dict[str, Any], tp: TensorParallel = NO_TP):
        super().__init__()
        hidden, heads, eps = hf["n_embd"], hf["n_head"], hf.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads, heads, hidden // heads, True, True, tp=tp)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(hidden, hf.get("n_inner") or 4 * hidden, tp)

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), positions, meta, None)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, hf: dict[str, Any], max_model_len: int, parallel: Parallel = SINGLE):
        super().__init__()
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {act!r} is not supported (gelu_new only)")
        self.parallel = parallel
        first, last = parallel.is_first_stage, parallel.is_last_stage
        hidden = hf["n_embd"]
        # wte embeds on the first stage and is the (tied) LM head on the last
        self.wte = nn.Embedding(hf["vocab_size"], hidden) if first or last else None
        self.wpe = nn.Embedding(hf["n_positions"], hidden) if first else None
        self.stage = parallel.layers(hf["n_layer"])
        self.h = nn.ModuleList(
            GPT2Block(hf, parallel.tp) if i in self.stage else StageMissing()
            for i in range(hf["n_layer"])
        )
        eps = hf.get("layer_norm_epsilon", 1e-5)
        self.ln_f = nn.LayerNorm(hidden, eps=eps) if last else None

    @property
    def attentions(self) -> list[Attention]:
        return [self.h[i].attn for i in self.stage]

    def forward(self, input_ids, positions, meta: AttentionMetadata, hidden=None) -> torch.Tensor:
        """`hidden`: the previous stage's output (pipeline parallelism), else None."""
        x = self.wte(input_ids) + self.wpe(positions) if hidden is None else hidden
        for i in self.stage:
            x = self.h[i](x, positions, meta)
        return self.ln_f(x) if self.ln_f is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.wte.weight)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor):
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith(".attn.bias") or "masked_bias" in name:
            return  # tied to wte / causal-mask buffers of old checkpoints
        if name.endswith(CONV1D):
            tensor = tensor.t()
        name, _ = self.parameter_for(name)
        if name not in params:
            if on_other_stage(name, self.stage, self.parallel.pp_size):
                return
            raise KeyError(f"checkpoint tensor {name!r} has no place in GPT2LMHeadModel")
        params[name].data.copy_(self.shard(name, tensor))

    def parameter_for(self, name: str) -> tuple[str, None]:
        """A checkpoint name as our parameter's (GPT-2 stores c_attn fused as we do)."""
        name = name.removeprefix("transformer.")
        return name.replace("attn.c_attn", "attn.qkv_proj").replace(
            "attn.c_proj", "attn.o_proj"
        ), None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of a checkpoint tensor (already in [out, in] layout)."""
        tp = self.parallel.tp
        if tp.size == 1:
            return tensor
        if "attn.qkv_proj" in name:  # q, k, v stacked: this rank's heads of each
            return torch.cat([tp.shard(part, 0) for part in tensor.chunk(3, 0)])
        if "mlp.c_fc" in name:
            return tp.shard(tensor, 0)
        if name.endswith(("attn.o_proj.weight", "mlp.c_proj.weight")):
            return tp.shard(tensor, 1)
        if name.endswith(("attn.o_proj.bias", "mlp.c_proj.bias")):
            return tp.row_bias(tensor)
        return tensor
