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
Rounds interleave the arms (their order rotates each round), so drift on a shared box
hits all alike; each arm's figure is its median over the rounds, with min-max spread,
and its ratio to the base's median. Prints a table, then one JSON line.
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


def run(engine: LLMEngine, loras: list[str | None]) -> float:
    """16 streams at once; generated tokens per second."""
    rng = random.Random(0)
    for i, lora in enumerate(loras):
        prompt = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(PROMPT)]
        params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, lora=lora)
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return STREAMS * OUTPUT / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    on_cpu = args.device == "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model(root / "base")
        common = dict(device=args.device, max_model_len=512, num_kv_blocks=256, max_num_seqs=16)
        engines = {"base": LLMEngine(root / "base", **common)}
        arms: dict[str, tuple[str, list[str | None], str]] = {"base": ("base", [None] * 16, "")}
        for rank in (16, 64):
            adapters = make_adapters(root / "base", root, rank)
            engines[f"r{rank}"] = LLMEngine(
                root / "base", **common, max_loras=ADAPTERS, max_lora_rank=rank,
                lora_modules=adapters,
            )  # fmt: skip
            names = [list(adapters)[i % ADAPTERS] for i in range(STREAMS)]
            default = engines[f"r{rank}"].lora.path  # what this device runs
            arms[f"r{rank}"] = (f"r{rank}", names, default)
            for path in [p for p in PATHS if p != default and on_cpu]:
                if path != "c" or engines[f"r{rank}"].lora.kernels is not None:
                    arms[f"r{rank}-{path}"] = (f"r{rank}", names, path)
        arms["base-on-lora"] = ("r16", [None] * 16, engines["r16"].lora.path)
        for engine, loras, path in arms.values():  # warm-up, each arm once
            if path:
                engines[engine].lora.use_path(path)
            run(engines[engine], loras[:2])
        figures: dict[str, list[float]] = {name: [] for name in arms}
        order = list(arms)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                engine, loras, path = arms[name]
                if path:
                    engines[engine].lora.use_path(path)
                figures[name].append(run(engines[engine], loras))
                print(f"  round {r + 1}: {name:13s} {figures[name][-1]:8.1f} tok/s", flush=True)
    base = median(figures["base"])
    rows = {
        name: {
            "tok_s": median(values),
            "min": min(values),
            "max": max(values),
            "ratio": median(values) / base,
        }
        for name, values in figures.items()
    }
    print(f"\n{STREAMS} streams over {ADAPTERS} adapters, {PROMPT}+{OUTPUT} tokens, {args.device}")
    print(f"{'arm':14s} {'tok/s':>8s} {'min':>8s} {'max':>8s} {'x base':>7s}")
    for name, row in rows.items():
        print(
            f"{name:14s} {row['tok_s']:8.1f} {row['min']:8.1f} {row['max']:8.1f} "
            f"{row['ratio']:7.3f}"
        )
    best16 = rows["r16"]["ratio"]  # the path this device runs
    print(f"rank 16 >= 0.8x base: {'pass' if best16 >= 0.8 else 'FAIL'} ({best16:.3f})")
    print(json.dumps({"bench": "lora", "device": args.device, "threads": args.threads,
                      "rounds": args.rounds, "arms": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
