"""Swap a model's layers for quantized ones, save them, and load them back.

A quantized folder is the source folder (config.json, tokenizer, ...) with its weights
replaced by one `model.safetensors` in bitserve's own module names (fused `qkv_proj`,
`gate_up_proj`), and `quantization_config` added to config.json:

    {"quant_method": "bitserve", "method": "int8" | "int8-outlier" | "int4",
     "activations": "int8" | "bf16" (int8), "group_size": 32 (int4),
     "threshold": 6.0 (int8-outlier), "embedding": "int8", "tied_lm_head": false}

Every `nn.Linear` is quantized (the LM head too) except a MoE router, and so are a MoE
layer's stacked experts: one quantized layer per expert and matrix (`mlp.q13.E`, gate |
up, and `mlp.q2.E`, down), with the per-row int8 or per-group int4 of any other
linear, so each routed token runs its experts through the same kernels. Llama-family token
embeddings become int8 rows (they are a quarter of the 58M bench model). A tied LM head
shares the int8 embedding under `int8`; under the other methods it gets its own tensors.
`load_model` (bitserve/llm/models) calls `prepare_modules` on the meta-device model and
`load_weights` instead of its own loader when config.json says `quant_method: bitserve`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from bitserve import kernels as c
from bitserve.llm.quant.linear import (
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    Int8OutlierLinear,
    QuantLinear,
    tied_head,
)

log = logging.getLogger("bitserve.quant")

METHODS = ("int8", "int8-outlier", "int4")
GROUP_SIZES = (32, 64, 128)
WEIGHTS_FILE = "model.safetensors"
HUGE_WEIGHTS_FROM = 32 << 20  # int8 weights' bytes: from here, on huge pages


def is_quantized(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "bitserve"


def quantizable(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers to quantize, by module name (a MoE router stays as it is)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.endswith("mlp.gate")
    }


def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The sparse MoE layers (stacked experts), by module name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "quantize_experts")}


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def embedding_of(model: nn.Module) -> nn.Embedding | None:
    """The token embedding of a Llama-family model (GPT-2 reads `wte.weight` directly)."""
    embedding = getattr(model, "embed_tokens", None)
    return embedding if isinstance(embedding, nn.Embedding) else None


# -- quantize a full-precision model ---------------------------------------------------------
def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int = 32,
    outliers: dict[str, torch.Tensor] | None = None,
    threshold: float = 6.0,
    activations: str = "int8",
) -> dict[str, Any]:
    """Quantize `model` in place; returns its `quantization_config`.

    `outliers` (int8-outlier): per linear layer, the input channels to keep in fp32.
    `activations` (int8): "int8" (W8A8 above a few rows) or "bf16" (weight-only).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    tied = bool(getattr(model, "tie_word_embeddings", False))
    for name, linear in quantizable(model).items():
        idx = (outliers or {}).get(name)
        set_module(model, name, quantized_linear(linear, method, group_size, activations, idx))
    for moe in moe_layers(model).values():  # no activation profile: no outlier channels
        moe.quantize_experts(
            lambda linear, _: quantized_linear(linear, method, group_size, activations)
        )
    config = method_config(method, group_size, activations, threshold)
    config["embedding"] = None
    embedding = embedding_of(model)
    if embedding is not None:
        model.embed_tokens = Int8Embedding.from_float(embedding)
        config["embedding"] = "int8"
        if tied and method == "int8":
            model.lm_head = tied_head(model.embed_tokens, activations == "int8")
    config["tied_lm_head"] = tied and method == "int8" and embedding is not None
    if tied:
        model.tie_word_embeddings = False  # tie_weights() must not put a float weight back
    return config


def quantized_linear(
    linear: nn.Linear,
    method: str,
    group_size: int = 32,
    activations: str = "int8",
    outliers: torch.Tensor | None = None,
) -> QuantLinear:
    """`linear` quantized by `method` (`outliers`: int8-outlier's fp32 input channels)."""
    if method == "int8":
        return Int8Linear.from_float(linear, activations == "int8")
    if method == "int4":
        return Int4Linear.from_float(linear, group_size)
    if outliers is None:
        outliers = torch.zeros(0, dtype=torch.int64)
    return Int8OutlierLinear.from_float_with_outliers(linear, outliers)


def method_config(method: str, group_size: int, activations: str, threshold: float = 6.0) -> dict:
    """The `quantization_config` entries a method has (LLMs and encoders alike)."""
    config: dict[str, Any] = {"quant_method": "bitserve", "method": method}
    if method == "int8":
        config["activations"] = activations
    if method == "int4":
        config["group_size"] = group_size
    if method == "int8-outlier":
        config["threshold"] = threshold
    return config


# -- save ------------------------------------------------------------------------------------
def save_weights(model: nn.Module, folder: Path, qconfig: dict[str, Any]) -> int:
    """Write `model.safetensors` (bitserve module names); returns its size in bytes."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if qconfig.get("tied_lm_head") and name.startswith("lm_head."):
            continue
        key = tensor.data_ptr()
        if key in seen and tensor.numel():
            raise ValueError(f"{name} shares memory with another tensor; untie it first")
        seen.add(key)
        tensors[name] = tensor.detach().cpu().contiguous()
    path = folder / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt", "quant_method": "bitserve"})
    return path.stat().st_size


def write_config(source: Path, folder: Path, qconfig: dict[str, Any]) -> None:
    hf = json.loads((source / "config.json").read_text())
    hf["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


# -- load ------------------------------------------------------------------------------------
def header_shapes(folder: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = f.get_slice(name).get_shape()
    return shapes


def prepare_modules(model: nn.Module, folder: Path, qconfig: dict[str, Any]) -> None:
    """Replace layers by empty quantized ones shaped as the checkpoint says (on meta)."""
    if not is_quantized({"quantization_config": qconfig}):
        raise ValueError(
            f"{folder}/config.json: quantization_config.quant_method "
            f"{qconfig.get('quant_method')!r} is not supported (bitserve loads the folders "
            "that `bitserve quantize` writes)"
        )
    shapes = header_shapes(folder)
    for name, linear in quantizable(model).items():
        if f"{name}.qweight" in shapes:  # else full precision (or a head tied, below)
            set_module(model, name, empty_linear(linear, name, qconfig, shapes))
    for prefix, moe in moe_layers(model).items():
        if f"{prefix}.q13.0.qweight" in shapes:
            moe.quantize_experts(
                lambda linear, name, p=prefix: empty_linear(linear, f"{p}.{name}", qconfig, shapes)
            )
    embedding = embedding_of(model)
    if embedding is not None and "embed_tokens.qweight" in shapes:
        model.embed_tokens = Int8Embedding(*embedding.weight.shape, dtype=torch.get_default_dtype())
    if qconfig.get("tied_lm_head"):
        model.lm_head = nn.Identity()  # shares the int8 embedding once it is loaded
    if getattr(model, "tie_word_embeddings", False):
        model.tie_word_embeddings = False


def empty_linear(
    linear: nn.Linear, name: str, qconfig: dict[str, Any], shapes: dict[str, list[int]]
) -> QuantLinear:
    """An unfilled quantized layer in place of `linear`, shaped as the checkpoint says."""
    sizes = (linear.in_features, linear.out_features, linear.bias is not None)
    if qconfig["method"] == "int4":
        return Int4Linear(*sizes, qconfig["group_size"])
    if qconfig["method"] == "int8-outlier":
        return Int8OutlierLinear(*sizes, shapes[f"{name}.outlier_idx"][0])
    return Int8Linear(*sizes, qconfig.get("activations", "int8") == "int8")


def read_weights(model: nn.Module, folder: Path, strict: bool = True) -> None:
    """Copy every safetensors tensor of `folder` into `model`; each of the model's
    tensors must be there. `strict`: a checkpoint tensor with no place is an error."""
    state = model.state_dict(keep_vars=True)
    missing = set(state)
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in state:
                    if strict:
                        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                    continue
                state[name].data.copy_(f.get_tensor(name))
                missing.discard(name)
    if missing:
        raise KeyError(f"{folder}: tensors missing from the checkpoint: {sorted(missing)[:5]}")


def load_weights(model: nn.Module, folder: Path, qconfig: dict[str, Any]) -> None:
    """Fill the prepared model from safetensors, tie the head, pick the kernels."""
    read_weights(model, folder)
    if qconfig.get("tied_lm_head"):
        model.lm_head = tied_head(model.embed_tokens, qconfig.get("activations") != "bf16")
    prepare_kernels(model)
    log.info("%s", describe(model, qconfig))


def prepare_kernels(model: nn.Module) -> None:
    """Pick every layer's kernels now (not on the first request); free what they copied.
    (Small decode steps then run one C call per decoder layer, through `c_view()`.)"""
    # the int8 weights every decode step streams from memory, in one buffer on 2 MiB pages
    # (a tied head's are the embedding's tensor: moved once, both read the copy): a 246M
    # step at 2 threads 20.5-20.9 ms against 21.0-21.5 on 4 KiB pages, its prefill 2.5%
    # faster; weights that a CPU's cache holds stay where they are (the buffer's alignment
    # slack, up to 2 MiB, would be a tenth of a small model's int8 weights)
    weights = {id(m.qweight): m.qweight for m in model.modules() if isinstance(m, Int8Linear)}
    if sum(w.numel() for w in weights.values()) >= HUGE_WEIGHTS_FROM:
        c.onto_huge_pages_together(list(weights.values()))
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare()
            module.prepared_for = module.device
            if isinstance(module, Int4Linear):
                module.free_unpacked()


def describe(model: nn.Module, qconfig: dict[str, Any]) -> str:
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kernels = sorted({kernel_summary(m) for m in layers})
    return (
        f"quantized model ({qconfig['method']}): {len(layers)} linear layers, "
        f"embedding {qconfig.get('embedding') or 'full precision'}, "
        f"{weight_bytes(model) / 2**20:.1f} MiB of weights; kernels: {'; '.join(kernels)}"
    )


def kernel_summary(layer: QuantLinear) -> str:
    from bitserve.llm.quant.linear import SMALL_M

    if isinstance(layer, Int4Linear):
        if layer.c_weight is not None:
            return "int4: C kernel, int8 activations (bitserve/kernels)"
        return "int4: int4pack" if layer.use_pack else "int4: dequantize + matmul"
    if layer.c_weight is not None and layer.int8_activations:
        return f"{layer.method}: C int8 GEMM, int8 activations, every row count (bitserve/kernels)"
    small = "int8pack" if layer.use_pack else "dequantize + matmul"
    if layer.c_weight is not None:
        small = "C GEMV (bitserve/kernels)"
    large = "_int_mm" if layer.use_int_mm else small
    return f"{layer.method}: {small} up to {SMALL_M} rows, {large} above"


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters, buffers and kernel-ready tensors, each storage once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if isinstance(module, QuantLinear):
            tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.device.type != "meta" and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
