"""Mixtral (and the MoE layers Qwen3-MoE shares): the Llama decoder with a sparse
Mixture-of-Experts MLP.

A router (linear `gate`) scores every expert per token; the top-k experts (softmax,
then renormalised over the k unless config.json says `norm_topk_prob: false`) each run
a SwiGLU MLP on the tokens routed to them, and the weighted outputs are summed.
`tokens_per_expert` counts routed tokens: the per-expert load metric, accumulated on
the device and read only when the metrics are asked for.

Two ways through the experts, chosen by the shapes only:
- dense (a GPU's path, and the CPU without the C kernels, up to DENSE_TOKENS rows): every
  expert runs on every row and its output is weighted by the row's routing weight, 0
  where the router did not pick it. No host read, the same ops at any batch, so it is
  what a CUDA graph captures; it reads every expert's weights, which a decode step of
  more than a few rows does anyway, and a memory-bound step does not notice the extra
  FLOPs. (A grouped-GEMM kernel would read only the routed experts at batch 1.)
- sparse (the CPU with the C kernels, or more rows than DENSE_TOKENS, a prefill): each
  routed expert runs on its own rows only; it reads which experts were routed to on
  the host (one sync per layer).

Expert weights are stacked, `w13` [E, 2I, H] (gate | up) and `w2` [E, H, I], whatever
the checkpoint's naming: Mixtral's `experts.N.w1/w3/w2`, Qwen's
`experts.N.gate_proj/up_proj/down_proj`, or transformers 5's own stacked
`experts.gate_up_proj` / `experts.down_proj`.

Under tensor parallelism every rank holds every expert, each cut like a dense MLP
(w1/w3 by intermediate rows, w2 by intermediate columns): the replicated router
sends each token to the same experts on every rank, the work per rank is even
whatever it picks, and the MoE output needs the same single all-reduce as a dense
MLP (no all-to-all, as expert parallelism would).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels as c
from bitserve.llm.models.layers import NO_TP
from bitserve.llm.models.llama import DecoderLayer, LlamaForCausalLM, attention_shape
from bitserve.llm.parallel import TensorParallel

DENSE_TOKENS = 256  # up to this many rows, every expert runs on every row (no host read)


def expert_intermediate(hf: dict[str, Any]) -> int:
    """One expert's intermediate size (Qwen's `moe_intermediate_size`, else Mixtral's)."""
    return hf.get("moe_intermediate_size") or hf["intermediate_size"]


def num_experts(hf: dict[str, Any]) -> int:
    return hf.get("num_local_experts") or hf["num_experts"]


class SparseMoE(nn.Module):
    kernels: c.Kernels | None = None  # the CPU's C kernels (kernels.attach): sparse path
    row_mask: torch.Tensor | None = None  # set per step: 1 for the rows to count, 0 padding

    def __init__(self, hf: dict[str, Any], tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp
        hidden, inter = hf["hidden_size"], expert_intermediate(hf) // tp.size
        self.num_experts, self.top_k, self.intermediate = (
            num_experts(hf),
            hf["num_experts_per_tok"],
            inter,
        )
        self.normalize = hf.get("norm_topk_prob", True)
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))  # gate, up
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.q13: nn.ModuleList | None = None  # quantized experts (bitserve/llm/quant), per expert
        self.q2: nn.ModuleList | None = None
        self.reset_buffers()

    def quantize_experts(self, make) -> None:
        """Replace the stacked fp weights by one quantized layer per expert and matrix:
        `make(linear, name)` gets an `nn.Linear` view of expert e's w13 ("q13.e") or w2
        ("q2.e") and returns its quantized layer. The stacks are dropped."""
        stacks = {"q13": self.w13, "q2": self.w2}
        for attr, stack in stacks.items():
            layers = []
            for e in range(self.num_experts):
                out_features, in_features = stack.shape[1:]
                linear = nn.Linear(in_features, out_features, bias=False, device=stack.device)
                linear.weight = nn.Parameter(stack.data[e], requires_grad=False)
                layers.append(make(linear, f"{attr}.{e}"))
            setattr(self, attr, nn.ModuleList(layers))
        del self.w13, self.w2
        self.w13 = self.w2 = None

    def up_gate(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w13[e]) if self.q13 is None else self.q13[e](x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w2[e]) if self.q2 is None else self.q2[e](x)

    def reset_buffers(self, device: str | torch.device = "cpu") -> None:
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        self.count(experts)
        if self.kernels is None and x.shape[0] <= DENSE_TOKENS:
            return self.tp.all_reduce(self.dense(x, weights, experts))
        return self.tp.all_reduce(self.sparse(x, weights, experts))

    def count(self, experts: torch.Tensor) -> None:
        """Add each row's experts to the load metric, on the device (no host read)."""
        if self.row_mask is None:
            ones = torch.ones_like(experts)
        else:  # a padded CUDA-graph step: its padding rows are not counted
            ones = self.row_mask[: experts.shape[0], None].expand_as(experts)
        self.tokens_per_expert.index_add_(0, experts.flatten(), ones.flatten())

    def dense(self, x, weights, experts) -> torch.Tensor:
        """Every expert on every row, weighted by the routing (0: not picked), in expert
        order as transformers adds them."""
        route = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        route.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = self.up_gate(e, x).split(self.intermediate, dim=-1)
            out += (self.down(e, F.silu(gate) * up) * route[:, e, None]).to(out.dtype)
        return out

    def sparse(self, x, weights, experts) -> torch.Tensor:
        """Each routed expert on its rows only (the experts are read on the host)."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token_idx, k_idx = torch.where(experts == e)
            gate, up = self.up_gate(e, x[token_idx]).split(self.intermediate, dim=-1)
            y = self.down(e, F.silu(gate) * up) * weights[token_idx, k_idx, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, hf: dict[str, Any], tp: TensorParallel) -> nn.Module:
        return SparseMoE(hf, tp)


EXPERT = re.compile(
    r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
STACKED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")  # [E, 2I, H], [E, H, I]
GATE, UP = ("w1", "gate_proj"), ("w3", "up_proj")


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer

    def load_weight(self, params, name: str, tensor: torch.Tensor) -> None:
        match = EXPERT.search(name) or STACKED.search(name)
        if match is None:
            name = name.replace("block_sparse_moe.gate", "mlp.gate")
            return super().load_weight(params, name, tensor)
        prefix = name[: match.start()].removeprefix("model.")
        if self.elsewhere(prefix):
            return
        moe = params[f"{prefix}mlp.w13"], params[f"{prefix}mlp.w2"]
        if match.re is STACKED:
            if match.group(1) == "down_proj":
                return moe[1].data.copy_(self.parallel.tp.shard(tensor, 2))
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                self.load_expert(moe, expert, "gate_proj", gate[expert])
                self.load_expert(moe, expert, "up_proj", up[expert])
            return
        self.load_expert(moe, int(match.group(1)), match.group(2), tensor)

    def load_expert(self, moe, expert: int, which: str, tensor: torch.Tensor) -> None:
        """One expert's gate, up or down weight into this rank's share of the stack."""
        (w13, w2), tp = moe, self.parallel.tp
        inter = w13.shape[1] // 2
        if which in ("w2", "down_proj"):  # row-parallel: this rank's intermediate columns
            w2.data[expert].copy_(tp.shard(tensor, 1))
        else:  # column-parallel: this rank's intermediate rows of gate or up
            rows = slice(0, inter) if which in GATE else slice(inter, 2 * inter)
            w13.data[expert, rows].copy_(tp.shard(tensor, 0))

    def tokens_per_expert(self) -> list[int]:
        """Routed tokens per expert, over this stage's MoE layers (all without PP)."""
        moe = [layer.mlp for layer in self.local_layers if isinstance(layer.mlp, SparseMoE)]
        return sum(mlp.tokens_per_expert for mlp in moe).tolist()


__all__ = ["MixtralForCausalLM", "attention_shape"]
