"""AWQ and GPTQ checkpoints (Hugging Face `quantization_config`) on bitserve's int4 kernel.

Both formats hold, per linear layer, 4-bit codes q, an integer zero per group and an fp16
scale per group and output, meaning W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with
g = k // group_size (or g_idx[k]); `bitserve quantize` is not involved. The layouts, as
their libraries write them (an int32 holds 8 codes, code j in bits 4j .. 4j + 3):

- AWQ, GEMM version (AutoAWQ `WQLinear_GEMM`): qweight int32 [in, out / 8] and qzeros
  int32 [in / group, out / 8], packed along the outputs in the interleaved order
  AWQ_ORDER (code j of an int32 holds output 8c + AWQ_ORDER[j]); scales fp16 [groups, out].
- GPTQ (AutoGPTQ / GPTQModel / optimum): qweight int32 [in / 8, out], packed along the
  inputs in order (code j of row r is input 8r + j); qzeros int32 [groups, out / 8] in
  order; scales fp16 [groups, out]; g_idx int32 [in], each input's group (act-order,
  `desc_act`, permutes it). `checkpoint_format` "gptq" (v1, the default and what
  transformers and vLLM read) stores each zero minus one, read back per code as code + 1
  (AutoGPTQ's unpacking; a symmetric checkpoint's 8 is stored as 7); "gptq_v2" (GPTQModel)
  stores the zero itself. `sym` changes only which zeros were chosen.

Each layer becomes an `Int4CheckpointLinear` (fp32 scales and zeros: the fp16 values and
W exactly; act-order as a permutation of the input columns that the kernel applies to x).
The parts bitserve fuses (q/k/v, gate/up) are concatenated along the outputs, so they
must share the group size and, under act-order, the g_idx (GPTQ derives both parts' order
from the same inputs). Everything else in the folder (embeddings, norms, an unquantized
LM head, biases) loads as any checkpoint does. Refused, naming the field: other bit
widths, AWQ versions other than GEMM (GEMV packs differently), AWQ without zero points,
GPTQ formats other than gptq/gptq_v2 (marlin, bitblas), group sizes other than 32, 64,
128 or -1 (one group).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from bitserve.llm.quant.linear import Int4CheckpointLinear
from bitserve.llm.quant.quantize import (
    header_shapes,
    prepare_kernels,
    quantizable,
    set_module,
    weight_bytes,
)

log = logging.getLogger("bitserve.quant")

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (32, 64, 128, -1)
GPTQ_FORMATS = ("gptq", "gptq_v2")
PARTS = ("qweight", "qzeros", "scales", "g_idx")
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def handles(qconfig: dict[str, Any]) -> bool:
    return str(qconfig.get("quant_method", "")).lower() in METHODS


def refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field} = {value!r}: {why}")


def check(qconfig: dict[str, Any]) -> tuple[str, int]:
    """(method, group_size) of a checkpoint bitserve can serve; else a ValueError that
    names the field."""
    method = qconfig["quant_method"].lower()
    bits = qconfig.get("bits", qconfig.get("w_bit"))
    if bits != 4:
        raise refuse("bits", bits, "bitserve serves 4-bit AWQ/GPTQ checkpoints only")
    group = qconfig.get("group_size", qconfig.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise refuse("group_size", group, f"bitserve's int4 kernel takes {GROUP_SIZES}")
    if method == "awq":
        version = str(qconfig.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("version", version, "only AWQ's GEMM packing is read")
        if qconfig.get("zero_point", True) is not True:
            raise refuse("zero_point", qconfig["zero_point"], "AWQ without zeros is not read")
        return method, group
    if qconfig.get("is_marlin_format"):
        raise refuse("is_marlin_format", True, "Marlin's repacked GPTQ is not read")
    fmt = qconfig.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise refuse("checkpoint_format", fmt, f"bitserve reads {GPTQ_FORMATS}")
    return method, group


# -- unpacking (the layouts in the module docstring) ------------------------------------------
def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> its 8 codes each, [..., C, 8] (code j: bits 4j .. 4j + 3)."""
    return (packed.to(torch.int32)[..., None] >> SHIFTS) & 15


def awq_codes(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [rows, out / 8] -> [rows, out] in output order (undo AWQ_ORDER)."""
    codes = nibbles(packed)
    ordered = torch.empty_like(codes)
    ordered[..., list(AWQ_ORDER)] = codes
    return ordered.reshape(packed.shape[0], -1)


def decode(method: str, parts: dict[str, torch.Tensor], v1: bool):
    """One checkpoint layer -> q [out, in], zero [out, groups] (integers), scale [out,
    groups] fp32, g_idx [in] or None."""
    scale = parts["scales"].float().t()
    if method == "awq":
        q = awq_codes(parts["qweight"]).t()
        zero = awq_codes(parts["qzeros"]).t()
        return q, zero, scale, None
    q = nibbles(parts["qweight"].t()).reshape(scale.shape[0], -1)
    zero = nibbles(parts["qzeros"]).reshape(scale.shape[1], -1).t()
    return q, zero + 1 if v1 else zero, scale, parts.get("g_idx")


def act_order(g_idx: torch.Tensor | None, group: int, width: int) -> torch.Tensor | None:
    """The permutation that makes each group's input columns contiguous, or None when
    they are already (no act-order). Every group must have `group` columns."""
    if g_idx is None:
        return None
    g_idx, plain = g_idx.long(), torch.arange(width) // group
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(f"g_idx does not give each group {group} input columns")
    return perm


# -- loading -----------------------------------------------------------------------------------
def layer_groups(model: nn.Module, folder: Path, ours) -> dict[str, dict[int | None, str]]:
    """Our layer name (one of `ours`) -> {shard of a fused layer (None: not fused):
    checkpoint prefix}."""
    layers: dict[str, dict[int | None, str]] = {}
    for name in header_shapes(folder):
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            target, shard = model.parameter_for(prefix + ".weight")
            if target.removesuffix(".weight") in ours:  # else load_weight refuses it by name
                layers.setdefault(target.removesuffix(".weight"), {})[shard] = prefix
    return layers


def prepare_modules(model: nn.Module, folder: Path, qconfig: dict[str, Any]) -> None:
    """Replace each layer the checkpoint quantizes by an empty Int4CheckpointLinear."""
    _, group = check(qconfig)  # (tensor/pipeline parallelism: refused by parallel.py)
    linears = quantizable(model)
    for name in layer_groups(model, folder, linears):
        linear = linears[name]
        size = linear.in_features if group == -1 else group
        sizes = (linear.in_features, linear.out_features, linear.bias is not None)
        set_module(model, name, Int4CheckpointLinear(*sizes, size))


def read(model: nn.Module, folder: Path, layers) -> dict[str, dict[str, torch.Tensor]]:
    """Load every plain tensor into the model; return the quantized ones by prefix."""
    prefixes = {p for shards in layers.values() for p in shards.values()}
    params = dict(model.named_parameters())
    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix, _, part = name.rpartition(".")
                if prefix in prefixes and part in PARTS:
                    found.setdefault(prefix, {})[part] = f.get_tensor(name)
                else:
                    model.load_weight(params, name, f.get_tensor(name))
    return found


def fill(layer: Int4CheckpointLinear, method: str, shards: list[dict], v1: bool) -> None:
    """The parts of one (fused) layer, in shard order, into `layer`."""
    decoded = [decode(method, parts, v1) for parts in shards]
    orders = [act_order(d[3], layer.group_size, layer.in_features) for d in decoded]
    perm = orders[0]
    if any((o is None) != (perm is None) or (o is not None and not torch.equal(o, perm))
           for o in orders):  # fmt: skip
        raise ValueError("the parts of a fused layer (q/k/v, gate/up) differ in g_idx")
    q = torch.cat([d[0] for d in decoded])
    if perm is not None:
        q = q[:, perm]
    layer.fill(q, torch.cat([d[1] for d in decoded]), torch.cat([d[2] for d in decoded]), perm)


def load_weights(model: nn.Module, folder: Path, qconfig: dict[str, Any]) -> None:
    """Fill the prepared model from the checkpoint and pick the kernels."""
    method, _ = check(qconfig)
    v1 = method == "gptq" and qconfig.get("checkpoint_format", "gptq") == "gptq"
    prepared = {n for n, m in model.named_modules() if isinstance(m, Int4CheckpointLinear)}
    layers = layer_groups(model, folder, prepared)
    found = read(model, folder, layers)
    for name, shards in layers.items():
        prefixes = [shards[s] for s in sorted(shards, key=lambda s: -1 if s is None else s)]
        for prefix in prefixes:
            missing = {"qweight", "qzeros", "scales"} - set(found.get(prefix, {}))
            if missing:
                raise KeyError(f"{folder}: {prefix} has no {', '.join(sorted(missing))}")
        fill(model.get_submodule(name), method, [found[p] for p in prefixes], v1)
    prepare_kernels(model)
    log.info(
        "%s checkpoint: %d int4 layers on the int4 kernel (fp32 scales), %.1f MiB of weights",
        method.upper(),
        len(layers),
        weight_bytes(model) / 2**20,
    )
