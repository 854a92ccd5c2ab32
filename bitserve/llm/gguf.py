"""GGUF import: a llama.cpp model file served by the LLM engine, in its own formats.

Families: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 (what both llama.cpp's
converter writes and transformers reads the GGUF metadata of). A `.gguf` file (or a
folder holding exactly one, with no config.json) is read with the `gguf` package, never
unpickled. Its metadata becomes a companion folder, once per file (under
`$BITSERVE_GGUF_CACHE`, default `~/.cache/bitserve/gguf`, keyed by the file's path, size
and mtime): `config.json` as transformers reads the metadata (`AutoConfig(gguf_file=...)`),
and the tokenizer transformers builds from `tokenizer.ggml.*`, with the file's
`tokenizer.chat_template`. The engine then reads that folder like any other, and takes
its weights from the file:

- a linear layer with a Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K tensor (Q4_K_M, Q5_K_M,
  Q6_K files mix these) becomes a `GgmlLinear` over the file's own bytes, one part per
  tensor in its own type (llm/quant/ggml.py, kernels/csrc/ggml.c): nothing is
  dequantized and re-quantized, so the model is llama.cpp's dequantized one up to fp32
  summation order;
- F32, F16, BF16 tensors (norms, biases, a float file's linears): fp32, exactly;
- the token embedding, whatever its type, is dequantized to fp32 once at load (a lookup
  reads a few rows; the LM head keeps the file's blocks, tied or not, as llama.cpp does);
- llama.cpp stores the q and k rows of a Llama/Mistral checkpoint permuted for its
  interleaved RoPE (`convert_hf_to_gguf.py`, `LlamaModel.permute`); they are permuted
  back (whole rows, so block rows too), and Gemma's norms, stored as 1 + w, go back to w;
- any other tensor type (Q2_K, Q3_K, IQ*, ...) is refused naming the tensor and type.
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

from bitserve import kernels as c
from bitserve.llm.quant.ggml import TYPES, GgmlLinear, dequantize
from bitserve.llm.quant.quantize import set_module

log = logging.getLogger("bitserve.llm")

ARCHITECTURES = {  # GGUF general.architecture / transformers model_type -> our class name
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",  # transformers' model_type for a gemma3 GGUF
    "phi3": "Phi3ForCausalLM",
}
PERMUTED = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter
UNIT_OFFSET_NORMS = ("gemma2", "gemma3")  # the converter wrote 1 + w for every norm
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
FAMILY_NAMES = {  # where a family's names depart from NAMES
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused
}
FAMILY_NAMES["gemma3"] = FAMILY_NAMES["gemma2"]
TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
EXACT = ("F32", "F16", "BF16")


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
    if "rope_factors_long.weight" in names:
        raise ValueError(f"{file}: Phi-3 longrope scaling in GGUF is not supported")
    config["architectures"] = [ARCHITECTURES[config.get("model_type", arch)]]
    config["tie_word_embeddings"] = "output.weight" not in names
    config["vocab_size"] = len(field(reader, "tokenizer.ggml.tokens", []) or []) or config.get(
        "vocab_size"
    )
    config["gguf"] = {"architecture": arch, "file": str(file)}
    if arch in UNIT_OFFSET_NORMS:
        gemma_settings(config, reader, arch)
    return config


def gemma_settings(config: dict[str, Any], reader, arch: str) -> None:
    """What transformers' GGUF reading leaves at Gemma's defaults: the soft-caps, from
    the metadata, and the attention scale, 1 / sqrt(head_dim) as llama.cpp takes it (all
    but Gemma 2 27B, whose GGUF does not say it differs)."""
    config["query_pre_attn_scalar"] = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = field(reader, f"{arch}.{key}")
        if value is not None or arch == "gemma3":  # Gemma 3 has none unless it says so
            config[key] = value


def save_tokenizer(file: Path, folder: Path) -> None:
    """The tokenizer transformers builds from tokenizer.ggml.*; none if it cannot."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as error:  # an unsupported tokenizer model: token ids still work
        log.warning("%s: no tokenizer from the GGUF metadata (%s): pass token ids", file, error)
        return
    template = field(open_reader(file), "tokenizer.chat_template")
    if template:  # transformers' GGUF reader leaves it out
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))


# -- weights -----------------------------------------------------------------------------
def hf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> transformers' (e.g. blk.3.attn_q.weight)."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = NAMES | FAMILY_NAMES.get(arch, {})
        if part not in names:
            raise KeyError(f"GGUF tensor {name!r} has no place in the model")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    if base not in TOP:
        raise KeyError(f"GGUF tensor {name!r} has no place in the model")
    return f"{TOP[base]}.{kind}"


def check_type(tensor) -> str:
    """The tensor's ggml type name; a type bitserve cannot read is refused by name."""
    kind = tensor.tensor_type.name
    if kind not in TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name}: type {kind} is not supported "
            f"(supported: {', '.join(TYPES)})"
        )
    return kind


def to_float(tensor) -> torch.Tensor:
    """A GGUF tensor as fp32 [rows, cols] in transformers' orientation (ggml lists dims
    innermost first): F32/F16/BF16 exactly, a block format as llama.cpp dequantizes it."""
    kind = check_type(tensor)
    shape = [int(d) for d in reversed(tensor.shape)]
    if kind == "F32":
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(shape))
    if kind == "F16":
        array = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
        return torch.from_numpy(array).view(shape)
    return dequantize(kind, raw_rows(tensor), shape[-1]).view(shape)


def raw_rows(tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 [rows, row bytes], copied off the file (huge pages:
    the kernels stream them)."""
    data = np.asarray(tensor.data).view(np.uint8)
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    out = c.empty_huge_pages((rows, data.size // rows), torch.uint8)
    out.numpy()[:] = data.reshape(rows, -1)  # (torch would warn: the file is read-only)
    return out


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (pairs interleaved per head); whole rows
    move, so it applies as well to a block format's raw rows."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_weights(
    model: nn.Module, file: Path, hf: dict[str, Any], activations: str = "int8"
) -> None:
    """Fill `model` (fp32, built from the companion config) from `file`. Linear layers
    with a block-format tensor become `GgmlLinear`s over the file's bytes, meeting
    `activations` ("int8" or "fp32": EngineConfig.gguf_activations); everything else
    (norms, biases, F32/F16/BF16 linears, the token embedding) is loaded as fp32."""
    reader = open_reader(file)
    arch = hf.get("gguf", {}).get("architecture", hf.get("model_type"))
    params = dict(model.named_parameters())
    linears: dict[str, dict[int, tuple[str, Any]]] = {}  # module -> shard -> (name, tensor)
    for tensor in reader.tensors:
        check_type(tensor)
        name = hf_name(tensor.name, arch)
        target, shard = model.parameter_for(name)
        if target not in params and model.elsewhere(target):
            continue  # another pipeline stage's
        if target.endswith("_proj.weight") or target == "lm_head.weight":
            linears.setdefault(target.removesuffix(".weight"), {})[shard or 0] = (name, tensor)
        else:
            model.load_weight(params, name, prepared(tensor, name, arch, hf))
    if model.tie_word_embeddings and model.lm_head is not None:
        # llama.cpp reads the token embedding as the output matrix, in its own type
        token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        linears["lm_head"] = {0: ("lm_head.weight", token_embd)}
    for module, shards in linears.items():
        parts = [shards[i] for i in sorted(shards)]
        if all(t.tensor_type.name in EXACT for _, t in parts):  # fp32 (a tied head: skipped)
            for name, t in parts:
                model.load_weight(params, name, prepared(t, name, arch, hf))
            continue
        if model.parallel.tp.size > 1:
            raise ValueError(f"{file}: block formats are not served under tensor parallelism")
        old = model.get_submodule(module)
        set_module(model, module, ggml_linear(old, parts, arch, hf, activations))


def prepared(tensor, name: str, arch: str, hf: dict[str, Any]) -> torch.Tensor:
    """A tensor as fp32 in transformers' form: q/k rows permuted back, Gemma's norms
    stored as w - 1 again."""
    weight = to_float(tensor)
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        weight = unpermute(weight, heads_of(name, hf))
    if arch in UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
        weight = weight - 1  # the converter stored 1 + w
    return weight


def heads_of(name: str, hf: dict[str, Any]) -> int:
    heads = hf["num_attention_heads"]
    return heads if "q_proj" in name else hf.get("num_key_value_heads") or heads


def ggml_linear(
    old: nn.Module, parts: list, arch: str, hf: dict[str, Any], activations: str = "int8"
) -> GgmlLinear:
    """The parts (q, k, v or gate, up, or one tensor) as one GgmlLinear, in their own
    types; the old layer's bias (loaded as fp32 already) carried over."""
    blocks = []
    for name, tensor in parts:
        kind = check_type(tensor)
        rows = raw_rows(tensor)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            rows = unpermute(rows, heads_of(name, hf)).contiguous()
        blocks.append((kind, rows))
    bias = getattr(old, "bias", None)
    in_features = int(parts[0][1].shape[0])  # ggml lists the innermost dimension first
    return GgmlLinear(in_features, blocks, None if bias is None else bias.data, activations)
