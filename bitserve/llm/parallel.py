"""Tensor and pipeline parallelism: which heads, columns and layers each rank holds,
and the collectives between the ranks.

Tensor parallelism (TP), Megatron-style, inside each layer:
- `qkv_proj` and `gate_up_proj` are column-parallel: each rank keeps its own attention
  heads (q, k and v sharded separately, so a rank's slice of the fused weight is its
  heads) and its slice of the intermediate columns (gate and up sharded separately);
- `o_proj` and `down_proj` are row-parallel: each rank multiplies its slice and one
  all-reduce sums the partial outputs, once after attention and once after the MLP.
  A row-parallel bias lives on TP rank 0 only, so the sum adds it once;
- the KV cache is split by head with the heads: each rank's pool holds its kv heads;
- Mixtral's experts: every rank keeps every expert, each expert's intermediate split
  like a dense MLP. Routing is then identical on every rank (the router is
  replicated), every rank does the same share of work whatever the router picks, and
  the MoE needs no all-to-all: the one all-reduce after the MLP is the same one;
- embeddings and the LM head are replicated, not vocab-parallel: no gather of logits,
  and only the rank that samples (rank 0, or the last stage's TP rank 0) computes
  them. The cost is vocab x hidden of memory on every rank.

Pipeline parallelism (PP): stage s holds the contiguous layers `stage_layers(...)`;
the first stage embeds, the last normalises and computes logits; hidden states go
from stage to stage with send/recv (this code keeps one residual stream: each
decoder layer adds into `x`, so there is no separate residual to send).

Ranks: global rank = pp_rank * tp_size + tp_rank; rank 0 is the engine's process.
Groups are built from a TCPStore ("stateless", as vLLM's StatelessProcessGroup),
never torch.distributed's default group, so two parallel engines (two versions of a
model in one server) can live in one process. gloo on CPU, NCCL on cuda; the
control group that carries each step's plan is always gloo, on the host.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

IDLE_TIMEOUT = timedelta(days=30)  # workers wait this long for the next step
CONTROL_BYTES = 64 << 10  # one step's plan in one broadcast, up to this size
STARTUP_TIMEOUT_S = 600.0  # at least this long for workers to start and load their share
LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # a decoder layer's parameter name


def divide(n: int, size: int, field_name: str) -> int:
    if n % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {field_name}={n}: "
            f"pick a tensor_parallel_size that divides it"
        )
    return n // size


def check_parallel(hf: dict[str, Any], tp: int, pp: int) -> None:
    """Refuse a split the model cannot take, naming the config.json field."""
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not hf:
        return
    if hf.get("quantization_config") and tp * pp > 1:
        raise ValueError(
            "a quantized checkpoint (quantization_config in config.json) is not split yet: "
            "run it with tensor_parallel_size=1 and pipeline_parallel_size=1"
        )
    gpt2 = "n_head" in hf
    heads_key = "n_head" if gpt2 else "num_attention_heads"
    divide(hf[heads_key], tp, heads_key)
    if not gpt2 and hf.get("num_key_value_heads"):
        divide(hf["num_key_value_heads"], tp, "num_key_value_heads")
    if gpt2:
        divide(hf.get("n_inner") or 4 * hf["n_embd"], tp, "n_inner (4 * n_embd)")
    elif "intermediate_size" in hf:
        divide(hf["intermediate_size"], tp, "intermediate_size")
    if hf.get("moe_intermediate_size"):  # Qwen-MoE experts are cut like a dense MLP
        divide(hf["moe_intermediate_size"], tp, "moe_intermediate_size")
    layers_key = "n_layer" if gpt2 else "num_hidden_layers"
    if hf.get(layers_key, pp) < pp:
        raise ValueError(
            f"pipeline_parallel_size={pp} is more than the model's {layers_key}={hf[layers_key]}"
        )


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Contiguous, balanced: stage sizes differ by at most one layer."""
    return range(pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size)


def on_other_stage(name: str, stage: range, pp_size: int) -> bool:
    """Whether a parameter belongs to another pipeline stage (and is not loaded here):
    a layer outside `stage`, or, with stages, an embedding/norm/head this one lacks."""
    match = LAYER.search(name)
    if match is not None:
        return int(match.group(1)) not in stage
    return pp_size > 1


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its stage's TP group; size 1 costs one int compare."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch ProcessGroup (gloo or NCCL) of this stage's ranks

    def shard(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's contiguous slice along `dim` (sizes are checked at config time)."""
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim)[self.rank]

    def row_bias(self, tensor: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's bias: added on rank 0 only, so the all-reduce adds it once."""
        return tensor if self.rank == 0 else torch.zeros_like(tensor)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x


@dataclass(frozen=True)
class Parallel:
    """Everything a rank knows about the split: its TP group, its stage, the channels."""

    tp: TensorParallel = field(default_factory=TensorParallel)
    pp_rank: int = 0
    pp_size: int = 1
    world: Any = None  # all ranks: activations and logits between stages
    control: Any = None  # all ranks, gloo: each step's plan from rank 0
    timeout: timedelta = timedelta(seconds=120)  # rank 0's wait for a step's plan to go out

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp.size + self.tp.rank

    @property
    def world_size(self) -> int:
        return self.tp.size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """Whether this rank computes logits: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp.rank == 0

    @property
    def sampler_rank(self) -> int:
        """The global rank that computes logits (rank 0 receives them from it)."""
        return (self.pp_size - 1) * self.tp.size

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp_rank, self.pp_size)

    # -- activations between stages (same TP rank, next stage) ---------------------------
    def send_next(self, x: torch.Tensor, tag: int):
        return self.send(x, self.rank + self.tp.size, tag)

    def recv_prev(self, x: torch.Tensor, tag: int) -> torch.Tensor:
        return self.recv(x, self.rank - self.tp.size, tag)

    def send(self, x: torch.Tensor, dst: int, tag: int):
        return self.world.send([x.contiguous()], dst, tag)

    def recv(self, x: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        self.world.recv([x], src, tag).wait()
        return x

    def min_over_ranks(self, n: int, device: torch.device, timeout: timedelta) -> int:
        """The smallest `n` of all ranks (the KV blocks every rank's pool can hold),
        waiting up to `timeout`: the first collective, after each rank loaded its share."""
        import torch.distributed as dist

        value = torch.tensor([n], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        options.timeout = timeout
        self.world.allreduce([value], options).wait()
        return int(value)

    # -- the step plan, rank 0 to everyone ----------------------------------------------
    def broadcast_object(self, obj: Any) -> None:
        """Rank 0's side: workers wait for a plan without limit (an idle engine sends
        none), but rank 0 gives up on a worker that does not take it (stopped, hung).
        One broadcast of a fixed-size message (length, then the pickle) per step; a
        plan that does not fit sends its rest in a second one."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, self.timeout
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        message = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        message[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = min(len(data), CONTROL_BYTES - 8)
        message[8 : 8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        self.control.broadcast([message], options).wait()
        if len(data) > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            self.control.broadcast([rest], options).wait()

    def receive_object(self) -> Any:
        message = torch.empty(CONTROL_BYTES, dtype=torch.uint8)
        self.control.broadcast(message, 0).wait()
        size = int(message[:8].view(torch.int64))
        data = message[8 : 8 + size].numpy().tobytes()
        if size > CONTROL_BYTES - 8:
            rest = torch.empty(size - (CONTROL_BYTES - 8), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return pickle.loads(data)


SINGLE = Parallel()


def make_group(backend: str, store, rank: int, size: int, timeout: timedelta):
    """A process group over `store` that never touches torch.distributed's global state."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def init_parallel(config, rank: int, store) -> Parallel:
    """Connect this rank's groups. Data groups first (short timeout): once they are up,
    every rank is alive, and the control group (long timeout: an idle engine sends
    nothing for hours) cannot wait on a rank that never came."""
    import torch.distributed as dist

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    timeout = timedelta(seconds=config.distributed_timeout_s)
    backend = "gloo" if config.on_cpu else "nccl"
    pp_rank, tp_rank = divmod(rank, tp)
    tp_group = None
    if tp > 1:
        prefix = dist.PrefixStore(f"tp{pp_rank}/", store)
        tp_group = make_group(backend, prefix, tp_rank, tp, timeout)
    world = make_group(backend, dist.PrefixStore("world/", store), rank, tp * pp, timeout)
    control = make_group("gloo", dist.PrefixStore("control/", store), rank, tp * pp, IDLE_TIMEOUT)
    return Parallel(TensorParallel(tp_rank, tp, tp_group), pp_rank, pp, world, control, timeout)


class StageMissing(nn.Module):
    """A layer that lives on another pipeline stage: keeps the layer indices (and so the
    parameter names) of the checkpoint, holds nothing."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer lives on another pipeline stage")
