"""GGUF files as llama.cpp users have them, decoded by bitserve in their own formats.

    .venv/bin/python -m bench.gguf [--size 246m] [--threads 1] [--tokens 64] [--repeats 3]
        [--variants fp32,int8,int4,Q8_0,Q4_K_M]

One random-weight Llama of bench/llm_serving.py's shape (246m: hidden 1024, 16 layers,
GQA 16/4, intermediate 2816 = 11 x 256, so every K-quant row is whole super-blocks;
vocab 32000, untied head) is built in a temp dir and made into: bitserve's own int8 and
int4 (`bitserve quantize`'s functions, as bench/quant.py), and GGUF files by llama.cpp's
converter (F32) and `llama-quantize` (Q8_0, Q4_K_M), which bitserve serves through
`GgmlLinear` (kernels/csrc/ggml.c). Its tokenizer is the tests' small byte-level BPE
(the converter pads the vocab to 32000); prompts are token ids. Each variant decodes
greedily at batch 1 and 16 through the engine, the variants taking turns in each round,
best of `--repeats` (bench/quant.py's `measure`). "x read" is batch-1 decode's bytes
read per second (each weight once a step, one row of the embedding) against a plain
read of as many bytes measured here: the weight-read floor. The CPU model and its
AVX-512 flags are printed with the table and in the JSON line.

Needs the converter and llama-quantize (tools/fetch_gguf_converter.py,
tools/build_llama_quantize.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench.quant import against_fp32, load_engine, make_variants, measure, print_table
from tests.llm.conftest import build_tokenizer
from tools.llama_cpp import CONVERTER, QUANTIZE, convert, quantize

SIZES = {  # bench/llm_serving.py's 246m and 1b
    "246m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=5632),
}  # fmt: skip
VARIANTS = ("fp32", "int8", "int4", "Q8_0", "Q4_K_M")
GGUF_TYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q5_0")


def cpu() -> dict[str, object]:
    """The CPU's model name and AVX-512 flags, recorded with every figure."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = text.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {"model": model, "avx512": sorted(f for f in flags if f.startswith("avx512"))}


def build_hf(folder: Path, size: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SIZES[size], vocab_size=32000, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def make_files(root: Path, size: str, variants: list[str]) -> dict[str, tuple[Path, str]]:
    """variant -> (folder or .gguf, engine dtype)."""
    hf = build_hf(root / "hf", size)
    own = [v for v in variants if v in ("fp32", "bf16", "int8", "int4")]
    folders = make_variants(root, hf, own)
    ggufs = [v for v in variants if v in GGUF_TYPES]
    if ggufs:
        f32 = convert(hf, "f32", root / "f32.gguf")
        for kind in ggufs:
            folders[kind] = (quantize(f32, root / f"{kind}.gguf", kind), "float32")
    return {v: folders[v] for v in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="246m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    if not (CONVERTER.is_file() and QUANTIZE.is_file()):
        raise SystemExit(f"needs {CONVERTER} and {QUANTIZE} (tools/build_llama_quantize.sh)")
    torch.set_num_threads(args.threads)
    variants = ["fp32"] + [v for v in args.variants.split(",") if v != "fp32"]
    batches = [1, 16]
    os.environ.setdefault("BITSERVE_GGUF_CACHE", tempfile.mkdtemp(prefix="bitserve-gguf-"))
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building the {args.size} model and its variants ...", file=sys.stderr)
        files = make_files(Path(tmp), args.size, variants)
        engines = {name: load_engine(*files[name], max(batches)) for name in variants}
        print("measuring (the variants take turns) ...", file=sys.stderr)
        results = measure(engines, batches, args.tokens, args.repeats)
    against_fp32(results, batches)
    where = cpu()
    print(f"{args.size}, {args.threads} thread(s), {where['model']} ({' '.join(where['avx512'])})")
    print_table(results, batches)
    print(json.dumps({"bench": "gguf", "size": args.size, "threads": args.threads,
                      "tokens": args.tokens, "cpu": where, "load_avg_1m": os.getloadavg()[0],
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
