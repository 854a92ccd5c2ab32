"""Multi-LoRA serving cost: 16 streams over 4 adapters against the base model, one run.

    .venv/bin/python -m bench.lora [--rounds 3] [--threads 1] [--device cpu|cuda]

The random-weight ~58M Llama of bench/llm_throughput.py (hidden 512, 8 layers) and 4
random PEFT adapters per rank (16 and 64; q, k, v, o, gate, up, down, made with `peft`).
16 requests of 64 prompt tokens and 128 generated ones (ignore_eos) run at once through
`LLMEngine`, each arm on its own engine (built once; all of them resident):
  - base: an engine without LoRA (max_loras 0): the reference;
  - base-on-lora: the LoRA engine (rank 16) with no adapter on any request (the hooks' cost);
  - r16 / r64: request i uses adapter i % 4 (max_loras 4, max_lora_rank the rank), on the
    path this device runs (llm/lora.py: the C kernel on the CPU, dense on a GPU); on the
    CPU also the other paths, as `-grouped` (torch, each adapter over its rows) and
    `-dense` (every slot on every row, masked): the CPU's path is picked by measurement.
In a round every arm's streams run together, the engines stepping in turn (one step
each, the order rotating), so drift on a shared box hits all arms alike; an arm's tok/s
is its tokens over its own steps' time, its figure the median over the rounds, with
min-max spread, and its ratio to the base's median. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from bench.llm_throughput import SHAPE, build_model
from bitserve.llm.engine import LLMEngine
from bitserve.llm.lora import PATHS
from bitserve.llm.sampling_params import SamplingParams

STREAMS, ADAPTERS, PROMPT, OUTPUT = 16, 4, 64, 128
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for i in range(ADAPTERS):
        torch.manual_seed(i)
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
        folder = root / f"r{rank}-{i}"
        model.save_pretrained(folder)
        adapters[f"r{rank}-{i}"] = str(folder)
    return adapters


def add_streams(engine: LLMEngine, loras: list[str | None]) -> None:
    rng = random.Random(0)
    for i, lora in enumerate(loras):
        prompt = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(PROMPT)]
        params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, lora=lora)
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params)


def run_round(engines: dict[str, LLMEngine], arms: dict) -> dict[str, float]:
    """Every arm's 16 streams at once on its own engine, the engines stepping in turn
    (one step each, in an order that rotates): each arm's tok/s over its own steps' time."""
    for name, (_, loras) in arms.items():
        add_streams(engines[name], loras)
    busy = {name: 0.0 for name in arms}
    order = list(arms)
    while any(engines[name].has_unfinished_requests() for name in order):
        order = order[1:] + order[:1]
        for name in order:
            if engines[name].has_unfinished_requests():
                start = time.perf_counter()
                engines[name].step()
                busy[name] += time.perf_counter() - start
    return {name: STREAMS * OUTPUT / seconds for name, seconds in busy.items()}


def build_engines(root: Path, device: str) -> tuple[dict[str, LLMEngine], dict]:
    """One engine per arm (arm -> (its LoRA path or "", the streams' adapters))."""
    common = dict(device=device, max_model_len=512, num_kv_blocks=256, max_num_seqs=16)
    engines = {"base": LLMEngine(root / "base", **common)}
    arms: dict[str, tuple[str, list[str | None]]] = {"base": ("", [None] * STREAMS)}
    for rank in (16, 64):
        adapters = make_adapters(root / "base", root, rank)
        names = [list(adapters)[i % ADAPTERS] for i in range(STREAMS)]
        lora = dict(max_loras=ADAPTERS, max_lora_rank=rank, lora_modules=adapters)
        engine = engines[f"r{rank}"] = LLMEngine(root / "base", **common, **lora)
        default = engine.lora.path  # this device's (the C kernel on the CPU, else dense)
        arms[f"r{rank}"] = (default, names)
        if rank == 16:
            engines["base-on-lora"] = LLMEngine(root / "base", **common, **lora)
            arms["base-on-lora"] = (default, [None] * STREAMS)
        others = [p for p in PATHS if p not in (default, "c")] if device == "cpu" else []
        for path in others if rank == 16 else others[:1]:  # dense at 64: slowest, measured
            engines[f"r{rank}-{path}"] = LLMEngine(root / "base", **common, **lora)
            engines[f"r{rank}-{path}"].lora.use_path(path)
            arms[f"r{rank}-{path}"] = (path, names)
    return engines, arms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model(root / "base")
        engines, arms = build_engines(root, args.device)
        for name, (_, loras) in arms.items():  # warm-up
            add_streams(engines[name], loras[:2])
            while engines[name].has_unfinished_requests():
                engines[name].step()
        figures: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, value in run_round(engines, arms).items():
                figures[name].append(value)
                print(f"  round {r + 1}: {name:13s} {value:8.1f} tok/s", flush=True)
    report(figures, args)


def report(figures: dict[str, list[float]], args) -> None:
    """Each arm's median tok/s with its min-max, and its ratio to the base: the median
    of the per-round ratios (arms of one round ran under the same load), min-max too."""
    ratios = {
        name: [v / b for v, b in zip(values, figures["base"], strict=True)]
        for name, values in figures.items()
    }
    rows = {
        name: {
            "tok_s": median(values),
            "min": min(values),
            "max": max(values),
            "ratio": median(ratios[name]),
            "ratio_min": min(ratios[name]),
            "ratio_max": max(ratios[name]),
        }
        for name, values in figures.items()
    }
    print(f"\n{STREAMS} streams over {ADAPTERS} adapters, {PROMPT}+{OUTPUT} tokens, {args.device}")
    print(f"{'arm':14s} {'tok/s':>8s} {'min':>8s} {'max':>8s} {'x base':>7s} {'(min-max)':>13s}")
    for name, row in rows.items():
        print(
            f"{name:14s} {row['tok_s']:8.1f} {row['min']:8.1f} {row['max']:8.1f} "
            f"{row['ratio']:7.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
        )
    ratio16 = rows["r16"]["ratio"]  # the path this device runs
    print(f"rank 16 >= 0.8x base: {'pass' if ratio16 >= 0.8 else 'FAIL'} ({ratio16:.3f})")
    print(json.dumps({"bench": "lora", "device": args.device, "threads": args.threads,
                      "rounds": args.rounds, "arms": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
