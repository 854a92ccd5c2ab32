"""Quantization: weight memory and decode speed of fp32, bf16, int8, int4 in one run.

    .venv/bin/python -m bench.quant [--quick] [--threads 1] [--tokens 64]
        [--model HF_FOLDER] [--variants fp32,bf16,int8,int4]

The 58M random Llama-shaped benchmark model of bench/llm_throughput.py (hidden 512,
8 layers, vocab 32000, untied embeddings) is built into a temp dir (or --model: any
Llama-shaped HF folder, e.g. bench/llm_serving.py's 1b), then quantized with
`bitserve quantize`'s own functions (int8: per-channel int8 weights; int4: group 32).
Each variant loads through the engine (`LLMEngine`, as serve and LLM() do) and decodes
greedily at batch 1 and batch 16 (short prompts, `ignore_eos`); decode tok/s
counts the tokens after each request's first one, over the time after the prefill
step. The variants take turns within each repeat and the best run counts, so that a
busy spell on a shared machine does not land on one variant only. Weight memory is
what the loaded model holds (parameters, buffers, packed kernel weights; each storage
once). Ratios are against fp32 measured in this run. Batch-1 decode is bound by reading
the weights: "b1 GB/s" is the bytes a step reads (every weight but the embedding table,
of which it reads one row) times the steps per second, and "x read" that against a
plain read (torch's sum, these threads, best of 5) of as many bytes, measured here.
Goals (issue 8): int8 weights <= 0.27x fp32, int8 batch-1 decode >= 2x fp32, int4 >= 3x;
(issue 23, at ~1B) fp32 batch-1 >= 0.9 of the read, int8 >= 1.8x and int4 >= 2.5x fp32.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.llm_throughput import SHAPE, build_model
from bitserve.llm.config import EngineConfig
from bitserve.llm.engine import LLMEngine
from bitserve.llm.models import load_model
from bitserve.llm.quant.quantize import (
    quantize_model,
    save_weights,
    weight_bytes,
    write_config,
)
from bitserve.llm.sampling_params import SamplingParams

VARIANTS = ("fp32", "bf16", "int8", "int4")


def make_variants(root: Path, model: Path | None, variants) -> dict[str, tuple[Path, str]]:
    """variant -> (folder, engine dtype)."""
    fp32 = model
    if fp32 is None:
        fp32 = root / "fp32"
        build_model(fp32)
    folders = {"fp32": (fp32, "float32"), "bf16": (fp32, "bfloat16")}
    for method in [v for v in ("int8", "int4") if v in variants]:
        model = load_model(EngineConfig(model=fp32, device="cpu", num_kv_blocks=1))
        qconfig = quantize_model(model, method, group_size=32)
        out = root / method
        out.mkdir()
        write_config(fp32, out, qconfig)
        save_weights(model, out, qconfig)
        folders[method] = (out, "float32")
        del model
    return folders


def decode_tok_s(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s with `batch` requests in flight, prefill excluded."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        vocab = engine.config.hf_config.get("vocab_size", SHAPE["vocab_size"])
        prompt = [3 + (i * 7919 + j * 31) % (vocab - 3) for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    started, produced = None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if started is None:
            started = time.perf_counter()  # after the step that ran every prefill
            continue
        produced += len(outputs)
    return produced / (time.perf_counter() - started)


def load_engine(folder: Path, dtype: str, max_batch: int) -> LLMEngine:
    engine = LLMEngine(
        folder,
        dtype=dtype,
        device="cpu",
        max_model_len=1024,
        num_kv_blocks=max_batch * 8 + 8,
        max_num_seqs=max_batch,
    )
    decode_tok_s(engine, 1, 16, 4)  # warm-up: kernel choice, first allocations
    return engine


def measure(engines: dict[str, LLMEngine], batches: list[int], tokens: int, repeats: int):
    """Best of `repeats` per variant and batch, the variants taking turns in each round so
    that a busy spell on a shared machine hits all of them alike."""
    results = {
        name: {"weight_bytes": weight_bytes(e.runner.model), "step_bytes": step_bytes(e)}
        for name, e in engines.items()
    }
    for _ in range(repeats):
        for batch in batches:
            for name, engine in engines.items():
                key = f"decode_b{batch}_tok_s"
                speed = decode_tok_s(engine, batch, 16, tokens)
                results[name][key] = max(results[name].get(key, 0.0), speed)
    return results


def step_bytes(engine: LLMEngine) -> int:
    """What a batch-1 decode step reads: the bytes of every weight tensor (not their
    storages, which a packed weight pads to whole 2 MiB pages) but the embedding table
    (one row of it), unless the LM head is that table."""
    model = engine.runner.model
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    skip = set() if embed is None or tied else {id(m) for m in embed.modules()}
    seen: dict[int, int] = {}
    for module in model.modules():
        if id(module) in skip:
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def read_gb_s(nbytes: int) -> float:
    """A plain read of nbytes (fp32, torch's sum), best of 5."""
    data = torch.ones(nbytes // 4)
    best = min(timed(data.sum) for _ in range(5))
    return nbytes / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--model", type=Path, help="an HF Llama folder instead of the 58M")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="fp32 and any of these")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens, repeats = (16, 1) if args.quick else (args.tokens, args.repeats)
    variants = ["fp32"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "fp32"]
    batches = [1, 16]
    with tempfile.TemporaryDirectory() as tmp:
        print("building the bench model's int8/int4 copies ...", file=sys.stderr)
        folders = make_variants(Path(tmp), args.model, variants)
        engines = {name: load_engine(*folders[name], max(batches)) for name in variants}
        print("measuring (the variants take turns) ...", file=sys.stderr)
        results = measure(engines, batches, tokens, repeats)
    base = results["fp32"]
    for r in results.values():
        r["memory_x"] = r["weight_bytes"] / base["weight_bytes"]
        for b in batches:
            r[f"b{b}_x"] = r[f"decode_b{b}_tok_s"] / base[f"decode_b{b}_tok_s"]
        r["b1_GB_s"] = r["step_bytes"] * r["decode_b1_tok_s"] / 1e9
        r["read_GB_s"] = read_gb_s(r["step_bytes"])
        r["b1_x_read"] = r["b1_GB_s"] / r["read_GB_s"]
    print_table(results, batches)
    goals = {"fp32_b1_ge_0.9_read": base["b1_x_read"] >= 0.9}
    if "int8" in results:
        goals["int8_memory_le_0.27x"] = results["int8"]["memory_x"] <= 0.27
        goals["int8_b1_ge_2x"] = results["int8"]["b1_x"] >= 2.0
    if "int4" in results:
        goals["int4_b1_ge_3x"] = results["int4"]["b1_x"] >= 3.0
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    load = os.getloadavg()[0]
    print(json.dumps({"bench": "quant", "threads": args.threads, "tokens": tokens,
                      "load_avg_1m": load, "results": results, "goals": goals}))  # fmt: skip


def print_table(results: dict[str, dict], batches: list[int]) -> None:
    header = f"{'variant':<8}{'weights MiB':>12}{'x fp32':>8}"
    for b in batches:
        header += f"{f'b{b} tok/s':>12}{'x fp32':>8}"
    print(header + f"{'b1 GB/s':>9}{'x read':>8}")
    for name, r in results.items():
        line = f"{name:<8}{r['weight_bytes'] / 2**20:>12.1f}{r['memory_x']:>8.3f}"
        for b in batches:
            line += f"{r[f'decode_b{b}_tok_s']:>12.1f}{r[f'b{b}_x']:>8.2f}"
        print(line + f"{r['b1_GB_s']:>9.1f}{r['b1_x_read']:>8.2f}")


if __name__ == "__main__":
    main()
