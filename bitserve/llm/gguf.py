"""GGUF import: a llama.cpp model file served by the LLM engine (Llama, Mistral, Qwen2/3).

A `.gguf` file (or a folder holding exactly one, with no config.json) is read with
the `gguf` package, never unpickled. Its metadata becomes a companion folder, once per
file (under `$BITSERVE_GGUF_CACHE`, default `~/.cache/bitserve/gguf`, keyed by the
file's path, size and mtime): `config.json` as transformers reads the metadata
(`AutoConfig(gguf_file=...)`), and the tokenizer transformers builds from
`tokenizer.ggml.*`. The engine then reads that folder like any other, and takes its
weights from the file:

- F32, F16, BF16 tensors: converted to fp32, exactly;
- llama.cpp stores the q and k rows of a Llama/Mistral checkpoint permuted for its
  interleaved RoPE (`convert_hf_to_gguf.py`, `LlamaModel.permute`); they are permuted
  back, so the model is the HF one;
- Q8_0 (int8 codes, one fp16 scale per 32 weights) and Q4_0 (4-bit codes, one fp16
  scale per 32) have no exact bitserve form (bitserve's int8 has one scale per row, its
  int4 an asymmetric bf16 scale and zero per 32). A file whose linear weights are Q8_0
  is dequantized to fp32 and re-quantized with bitserve's int8 (per-row scales, the
  `bitserve quantize --method int8` path, int8 embedding included); Q4_0 with int4,
  group 32. That is a second rounding on top of llama.cpp's, measured in perplexity
  by tests/llm/test_gguf.py;
- any other tensor type (K-quants, IQ, ...) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

log = logging.getLogger("bitserve.llm")

ARCHITECTURES = {  # GGUF general.architecture / transformers model_type -> our class name
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PERMUTED = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter
NAMES = {  # llama.cpp tensor names -> transformers' (after "model.layers.N.")
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
EXACT = ("F32", "F16", "BF16")
METHODS = {"Q8_0": "int8", "Q4_0": "int4"}  # -> bitserve's quantization of the model


def gguf_file(model: Path) -> Path | None:
    """The GGUF file `model` names: itself, or the only *.gguf of a folder without
    config.json; None for a Hugging Face folder."""
    if model.is_file() and model.suffix == ".gguf":
        return model
    if model.is_dir() and not (model / "config.json").is_file():
        files = sorted(model.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None


def cache_dir() -> Path:
    root = os.environ.get("BITSERVE_GGUF_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bitserve" / "gguf"


def companion_folder(file: Path) -> Path:
    """config.json and tokenizer files for `file`, written once (atomic rename)."""
    stat = file.stat()
    key = f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    folder = cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    reader = open_reader(file)
    (tmp / "config.json").write_text(json.dumps(hf_config(file, reader), indent=2))
    save_tokenizer(file, tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process wrote it first (os.replace onto a full folder)
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def open_reader(file: Path):
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise ImportError("reading a .gguf file needs the `gguf` package") from error
    return GGUFReader(str(file))


def field(reader, name: str, default=None):
    f = reader.get_field(name)
    return default if f is None else f.contents()


def hf_config(file: Path, reader) -> dict[str, Any]:
    """transformers' reading of the metadata, with the class bitserve runs it with."""
    from transformers import AutoConfig

    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{file}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name).to_dict()
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{file}: llama3 RoPE scaling in GGUF (rope_freqs) is not supported")
    config["architectures"] = [ARCHITECTURES[config.get("model_type", arch)]]
    config["tie_word_embeddings"] = "output.weight" not in names
    config["vocab_size"] = len(field(reader, "tokenizer.ggml.tokens", []) or []) or config.get(
        "vocab_size"
    )
    config["gguf"] = {"architecture": arch, "file": str(file)}
    return config


def save_tokenizer(file: Path, folder: Path) -> None:
    """The tokenizer transformers builds from tokenizer.ggml.*; none if it cannot."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as error:  # an unsupported tokenizer model: token ids still work
        log.warning("%s: no tokenizer from the GGUF metadata (%s): pass token ids", file, error)
        return
    tokenizer.save_pretrained(str(folder))


# -- weights -----------------------------------------------------------------------------
def hf_name(name: str) -> str:
    """llama.cpp's tensor name -> transformers' (e.g. blk.3.attn_q.weight)."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in NAMES:
            raise KeyError(f"GGUF tensor {name!r} has no place in the model")
        return f"model.layers.{layer}.{NAMES[part]}.{kind}"
    if base not in TOP:
        raise KeyError(f"GGUF tensor {name!r} has no place in the model")
    return f"{TOP[base]}.{kind}"


def to_float(tensor) -> torch.Tensor:
    """A GGUF tensor as fp32 [rows, cols] in transformers' orientation (ggml lists dims
    innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in EXACT and kind not in METHODS:
        raise ValueError(
            f"GGUF tensor {tensor.name}: type {kind} is not supported "
            f"(supported: {', '.join(EXACT + tuple(METHODS))})"
        )
    shape = [int(d) for d in reversed(tensor.shape)]
    if kind == "F32":
        array = np.asarray(tensor.data, dtype=np.float32)
    elif kind == "F16":
        array = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:  # BF16 (stored as raw 16-bit words) and the block formats
        array = dequantize(tensor.data, GGMLQuantizationType[kind])
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a copy


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (pairs interleaved per head)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def quant_method(reader) -> str | None:
    """bitserve's method for the file's quantized linear weights, None when all exact."""
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")}
    methods = {METHODS[k] for k in kinds if k in METHODS}
    if len(methods) > 1:
        raise ValueError(f"GGUF mixes {sorted(kinds)}: one of Q8_0 or Q4_0 is supported")
    return methods.pop() if methods else None


def load_weights(model: nn.Module, file: Path, hf: dict[str, Any]) -> str | None:
    """Fill `model` (fp32, built from the companion config) from `file`; quantize it as
    its Q8_0/Q4_0 tensors say. Returns the bitserve method used, or None."""
    reader = open_reader(file)
    arch = hf.get("gguf", {}).get("architecture", hf.get("model_type"))
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    params = dict(model.named_parameters())
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weight = to_float(tensor)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = unpermute(weight, heads if "q_proj" in name else kv_heads)
        model.load_weight(params, name, weight)
    method = quant_method(reader)
    if method is not None:
        from bitserve.llm.quant.quantize import prepare_kernels, quantize_model

        quantize_model(model, method, group_size=32)
        prepare_kernels(model)
        log.info("%s: %s blocks re-quantized as bitserve %s", file, method.upper(), method)
    return method
