"""Model registry and the safetensors loader.

`architectures` in config.json picks the class; anything else is refused by name.
Weights are read with `safetensors.safe_open` (memory-mapped), or from a llama.cpp
GGUF file (`bitserve/llm/gguf.py`), never unpickled.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from bitserve.llm.config import EngineConfig
from bitserve.llm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from bitserve.llm.models.gpt2 import GPT2LMHeadModel
from bitserve.llm.models.layers import store_linears
from bitserve.llm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from bitserve.llm.models.mixtral import MixtralForCausalLM
from bitserve.llm.models.phi3 import Phi3ForCausalLM
from bitserve.llm.models.qwen3 import Qwen3ForCausalLM
from bitserve.llm.models.qwen3_moe import Qwen3MoeForCausalLM
from bitserve.llm.parallel import SINGLE, Parallel

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


class UnsupportedArchitecture(ValueError):
    pass


def model_class(config: EngineConfig) -> type[nn.Module]:
    names = config.hf_config.get("architectures") or ["<none in config.json>"]
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UnsupportedArchitecture(
        f"architecture {', '.join(names)} is not supported by bitserve's LLM engine "
        f"(supported: {', '.join(ARCHITECTURES)})"
    )


def load_model(config: EngineConfig, parallel: Parallel = SINGLE) -> nn.Module:
    """Build the model in the configured dtype and fill it from `*.safetensors`; under
    tensor/pipeline parallelism, only this rank's share (parallel.py)."""
    cls = model_class(config)
    quant = config.hf_config.get("quantization_config")
    quantized = quant_loader(quant)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with torch.device("meta"):
            model = cls(config.hf_config, config.max_model_len, parallel)
            if quantized is not None:
                quantized.prepare_modules(model, Path(config.model), quant)
        model = model.to_empty(device=config.device)
    finally:
        torch.set_default_dtype(previous)
    for module in model.modules():  # tables computed in __init__ were built on meta
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device=config.device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty made the tied parameters two
    if quantized is not None:
        quantized.load_weights(model, Path(config.model), quant)
    elif config.gguf_file is not None:
        from bitserve.llm import gguf

        gguf.load_weights(model, config.gguf_file, config.hf_config, config.gguf_activations)
    else:
        load_safetensors(model, Path(config.model))
    if config.weight_dtype is not config.torch_dtype:  # bfloat16 on the CPU
        store_linears(model, config.weight_dtype)
    return model.eval().requires_grad_(False)


def quant_loader(quant: dict[str, Any] | None) -> ModuleType | None:
    """The module that prepares and loads a `quantization_config`'s folder: AWQ/GPTQ
    (quant/checkpoints.py), else bitserve's own (quant/quantize.py, which refuses what it
    does not know by name); None for a full-precision folder."""
    if quant is None:
        return None
    from bitserve.llm.quant import checkpoints, quantize

    return checkpoints if checkpoints.handles(quant) else quantize


def load_safetensors(model: nn.Module, folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder} (pickled checkpoints are refused)")
    params = dict(model.named_parameters())
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                model.load_weight(params, name, f.get_tensor(name))
