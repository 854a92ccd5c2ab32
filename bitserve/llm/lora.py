"""LoRA adapters (PEFT's format) served over one base model, many resident, mixed in a step.

An adapter folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]); pickled `.bin` adapters are refused. A registered
adapter's weights stay on the host (`Adapter`); at most `max_loras` are resident in the
device's slots at once, the least recently used evicted when another is needed (its host
copy is copied in again when it is asked for next: eviction is invisible to requests).
The scheduler admits a request only while the running ones use at most `max_loras`
adapters, so every adapter of a step has a slot.

Each linear layer an adapter may target gets a `LoRALinear` (a forward hook adding the
deltas), laid out for the fused weights: q, k, v share `qkv_proj`, gate and up share
`gate_up_proj`. Per slot it holds A as [P*R, in] and B^T as [P*R, out] (P parts: 3 for
qkv, 2 for gate/up, else 1; R = `max_lora_rank`; part p's A rows at [p*R, p*R + r) and
its B columns over its own output slice; a smaller rank or an untargeted part is zero;
the scale alpha / r, or alpha / sqrt(r) under rsLoRA, folded into B). Per step,
`LoRAManager.set_rows` says which slot each row uses (-1: the base model alone).

The grouped low-rank matmul, three ways, picked by the device and measured by
`python -m bench.lora` (16 streams over 4 adapters at rank 16: c 0.86x the base model's
tok/s, grouped 0.61x, dense 0.59x on the CPU):
- c (the CPU with the C kernels, fp32): `bs_lora_add` (kernels/csrc/lora.c), one call
  per linear whatever the mix, each row through its own slot's A and B^T; the fused C
  decode layer calls it too (its `Weight`s point at the slots and at `row_slots`), so a
  step with adapters keeps one C call per layer;
- grouped (the CPU without them): per adapter in the step, over its rows only,
  `y[rows] += (x[rows] @ A^T) @ B^T`;
  with either, a step with no adapter row adds nothing;
- dense (a GPU): every slot on every row, `((x @ A_all^T) * mask) @ B_all^T`, the mask 1
  on a row's own slot's rank columns: two GEMMs whatever the mix, no host read, so a
  CUDA graph captures it (the mask is a static buffer the step writes).
Tensor and pipeline parallelism are refused with LoRA (the deltas are not sharded).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from bitserve.inference import InvalidRequest

PEFT_PREFIX = "base_model.model."
FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}  # our fused linears: parts per slot
_uids = itertools.count(1)


class AdapterError(InvalidRequest):
    """An adapter that cannot be served (400 naming it): not found, a rank past
    max_lora_rank, a target module the engine has no hook for."""


class AdapterNotFound(LookupError):
    """No adapter of that name is registered (404)."""


@dataclass
class Delta:
    """One target of an adapter: its part of the fused linear, A [r, in], B [out_part, r]
    with the scale folded in."""

    part: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class Adapter:
    name: str
    path: Path
    rank: int
    deltas: dict[str, list[Delta]]  # our module's name -> its parts
    uid: int = field(default_factory=lambda: next(_uids))  # the prefix cache's salt
    requests: int = 0  # metrics: requests admitted with it
    tokens: int = 0  # and tokens computed with it (prompt and generated)


def read_adapter(name: str, path: Path, model: nn.Module, max_rank: int) -> Adapter:
    """Read a PEFT adapter folder and map its tensors onto `model`'s linears."""
    path = Path(path)
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise AdapterError(
            f"lora_path: {path} must hold adapter_config.json and adapter_model.safetensors"
        )
    config = json.loads(config_file.read_text())
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 0 < rank <= max_rank:
        raise AdapterError(f"lora_path: adapter rank {rank} is past max_lora_rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise AdapterError(
                    f"lora_path: tensor {key!r} is not a LoRA A or B weight (whole weights, "
                    "modules_to_save, are not served)"
                )
            pairs.setdefault(module, {})[kind[0]] = f.get_tensor(key)
    deltas: dict[str, list[Delta]] = {}
    for module, ab in pairs.items():
        target, part = target_of(model, module)
        deltas.setdefault(target, []).append(Delta(part, ab["A"], ab["B"] * scale))
    return Adapter(name, path, rank, deltas)


def target_of(model: nn.Module, module: str) -> tuple[str, int]:
    """Our linear (its name) and the part of it that a checkpoint module is."""
    name, shard = model.parameter_for(module + ".weight")
    name = name.removesuffix(".weight")
    hooks = getattr(model, "lora_layers", {})
    if name not in hooks:
        raise AdapterError(f"lora_path: target module {module!r} is not supported by LoRA here")
    return name, shard or 0


class LoRALinear:
    """The per-slot A and B^T of one linear layer, and the forward hook that adds them."""

    def __init__(self, linear: nn.Linear, parts: int, manager: LoRAManager, sizes: list[int]):
        self.manager = manager
        self.width = parts * manager.max_rank  # rank columns per slot
        self.sizes = sizes  # each part's outputs
        w = linear.weight
        slots, out = manager.max_loras, w.shape[0]
        # in the activations' dtype: fp32 beside bf16 weights on the CPU (dtype bfloat16)
        dtype = torch.float32 if w.is_cpu and w.dtype is torch.bfloat16 else w.dtype
        self.a = torch.zeros(slots, self.width, linear.in_features, dtype=dtype, device=w.device)
        self.bt = torch.zeros(slots, self.width, out, dtype=dtype, device=w.device)
        linear.register_forward_hook(self.hook)
        manager.by_linear[id(linear)] = self

    def fill(self, slot: int, deltas: list[Delta]) -> None:
        """Copy an adapter's parts into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        r = self.manager.max_rank
        for d in deltas:
            rank, start = d.a.shape[0], sum(self.sizes[: d.part])
            cols = slice(d.part * r, d.part * r + rank)
            self.a[slot, cols].copy_(d.a)
            self.bt[slot, cols, start : start + d.b.shape[0]].copy_(d.b.t())

    def hook(self, module: nn.Module, inputs: tuple, y: torch.Tensor) -> torch.Tensor:
        rows = self.manager.rows
        if rows is None:
            return y
        x = inputs[0]
        if rows.path == "c":
            x = x if x.stride(-1) == 1 else x.contiguous()
            self.manager.kernels.lora_add(x, rows.slots, self.a, self.bt, y)
            return y
        if rows.path == "dense":
            slots, width = self.a.shape[0], self.width
            xa = (x @ self.a.view(-1, x.shape[-1]).t()).view(-1, slots, width)
            xa = xa * rows.mask[: x.shape[0], :, None]
            return y.addmm_(xa.view(x.shape[0], -1), self.bt.view(slots * width, -1))
        for slot, index in rows.groups:
            if isinstance(index, slice):
                y[index].addmm_(x[index] @ self.a[slot].t(), self.bt[slot])
            else:
                y.index_add_(
                    0, index, (x.index_select(0, index) @ self.a[slot].t()) @ self.bt[slot]
                )
        return y


PATHS = ("c", "grouped", "dense")


@dataclass
class StepRows:
    """Which slot each row of a step uses, as its path reads it: `slots` int32 [rows]
    (-1: none) for the C kernel, `groups` (slot, rows as a slice or an index tensor) for
    the grouped torch path, `mask` [rows, slots] for the dense one."""

    path: str
    slots: torch.Tensor | None = None
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    mask: torch.Tensor | None = None


class LoRAManager:
    """The registered adapters, the slots, LRU residency, and each step's rows."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, max_rows: int, kernels=None
    ):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.kernels = kernels  # the CPU's C kernels (fp32), else None
        device = next(model.parameters()).device
        self.adapters: dict[str, Adapter] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # uid -> slot, LRU first
        self.loads = self.evictions = 0
        self.rows: StepRows | None = None  # this step's (None: no adapter row)
        self.lock = threading.Lock()  # registration (any thread) vs a step's lookups
        self.by_linear: dict[int, LoRALinear] = {}
        # each row's slot (-1: none), the C path's: a static buffer the C layer's cached
        # params point to, so its rows past a step's stay -1
        self.row_slots = torch.full((max_rows,), -1, dtype=torch.int32)
        self.layers = {
            name: LoRALinear(linear, FUSED_PARTS.get(name.rpartition(".")[2], 1), self, sizes)
            for name, linear, sizes in lora_targets(model)
        }
        model.lora_layers = self.layers
        model.lora = self
        dtype = next(model.parameters()).dtype
        self.mask = torch.zeros(max_rows, max_loras, dtype=dtype, device=device)  # static
        self.use_path("dense" if device.type != "cpu" else "c" if kernels else "grouped")

    def use_path(self, path: str) -> None:
        """How the deltas are computed (the module docstring; tests and bench.lora try
        each). Dense is always on, the mask zero for rows without an adapter, so a CUDA
        graph captures the deltas; the others add nothing to a step with no adapter."""
        if path not in PATHS or (path == "c" and self.kernels is None):
            raise ValueError(f"LoRA path {path!r}: one of {PATHS} ('c' with the C kernels)")
        self.path = path
        self.mask.zero_()
        self.row_slots.fill_(-1)
        self.rows = StepRows("dense", mask=self.mask) if path == "dense" else None

    # -- registry (load / unload endpoints, lora_modules) -------------------------------
    def register(self, name: str, path: str | Path) -> Adapter:
        if not name or not isinstance(name, str):
            raise AdapterError("lora_name: must be a non-empty string")
        try:
            adapter = read_adapter(name, Path(path), self.model, self.max_rank)
        except AdapterError:
            raise
        except Exception as e:  # a malformed config or safetensors file
            raise AdapterError(f"lora_path: cannot read the adapter in {path}: {e}") from None
        with self.lock:
            if name in self.adapters:
                raise AdapterError(f"lora_name: adapter {name!r} is already loaded")
            self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Gone for new requests at once; one still running fails at its next step."""
        with self.lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
            self.resident.pop(adapter.uid, None)

    def get(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        return adapter

    def uid(self, name: str | None) -> int:
        """A request's adapter, as the prefix cache's salt and the runner's key (0: none)."""
        if name is None:
            return 0
        adapter = self.get(name)
        adapter.requests += 1
        return adapter.uid

    # -- slots --------------------------------------------------------------------------
    def slot(self, uid: int, in_step: set[int]) -> int:
        """The slot holding adapter `uid`, copied in now if it is not resident (the least
        recently used one not in this step makes room)."""
        if uid in self.resident:
            self.resident.move_to_end(uid)
            return self.resident[uid]
        adapter = next((a for a in self.adapters.values() if a.uid == uid), None)
        if adapter is None:
            raise AdapterNotFound("the request's LoRA adapter was unloaded")
        if len(self.resident) < self.max_loras:
            free = set(range(self.max_loras)) - set(self.resident.values())
            slot = min(free)
        else:
            victim = next(u for u in self.resident if u not in in_step)
            slot = self.resident.pop(victim)
            self.evictions += 1
        for name, layer in self.layers.items():
            layer.fill(slot, adapter.deltas.get(name, []))
        self.resident[uid] = slot
        self.loads += 1
        return slot

    def set_rows(self, row_uids: list[int], num_rows: int) -> None:
        """A step's rows (`num_rows` with a CUDA graph's padding): each one's adapter."""
        with self.lock:
            counts = Counter(row_uids)
            in_step = set(counts) - {0}
            slots = {uid: self.slot(uid, in_step) for uid in in_step}
            for adapter in self.adapters.values():
                adapter.tokens += counts.get(adapter.uid, 0)
        if self.path == "dense":
            mask = torch.zeros(num_rows, self.max_loras, dtype=self.mask.dtype)
            for row, uid in enumerate(row_uids):
                if uid:
                    mask[row, slots[uid]] = 1
            self.mask[:num_rows].copy_(mask, non_blocking=True)
            return
        if self.path == "c":  # (rows with none must be -1 for the C layer too)
            row_slots = torch.tensor([slots[uid] if uid else -1 for uid in row_uids])
            self.row_slots[:num_rows] = row_slots
            self.rows = StepRows("c", slots=row_slots.int()) if in_step else None
            return
        if not in_step:
            self.rows = None
            return
        groups = []
        for uid, slot in slots.items():
            index = [row for row, u in enumerate(row_uids) if u == uid]
            if index[-1] - index[0] + 1 == len(index):
                groups.append((slot, slice(index[0], index[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(index)))
        self.rows = StepRows("grouped", groups=groups)

    def fuses(self) -> bool:
        """Whether the fused C decode layer may run this step: no adapter row, or the C
        path (the layer adds the deltas)."""
        return self.rows is None or self.path == "c"

    def chunk(self, start: int, rows: int) -> None:
        """The fused layer runs rows start .. start + rows next: their slots to row 0 of
        the buffer its params point to."""
        if self.rows is not None:
            self.row_slots[:rows] = self.rows.slots[start : start + rows]

    def c_view(self, linear: nn.Module):
        """(a, bt, row slots) of a linear for the C layer's `Weight`, or None."""
        layer = self.by_linear.get(id(linear))
        if layer is None or self.kernels is None:
            return None
        return layer.a, layer.bt, self.row_slots

    def stats(self) -> dict[str, dict[str, int]]:
        """Per adapter: requests, tokens, whether resident (the metrics)."""
        with self.lock:
            return {
                a.name: {
                    "requests": a.requests,
                    "tokens": a.tokens,
                    "resident": int(a.uid in self.resident),
                }
                for a in self.adapters.values()
            }


def lora_targets(model: nn.Module):
    """(name, linear, each part's output sizes) for every linear an adapter may target:
    attention and dense-MLP projections (not the MoE experts or router, nor the head)."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "c_fc", "c_proj")
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf in names:
            parts = FUSED_PARTS.get(leaf, 1)
            out = module.weight.shape[0]
            if leaf == "qkv_proj" and hasattr(model, "packed_sizes"):
                sizes = model.packed_sizes(name)
            elif leaf == "gate_up_proj":
                sizes = [out // 2, out // 2]
            else:
                sizes = [out // parts] * parts
            yield name, module, sizes
