"""What structured outputs cost: 16 streams on tinylm, on the engine itself.

    .venv/bin/python -m bench.structured [--rounds 3] [--tokens 96] [--model FOLDER]

(a) 16 rows under a JSON schema against 16 free rows, output tokens per second;
(b) 8 guided + 8 free rows in one batch against 16 free rows: the free rows' time per
output token (TPOT). The variants rotate round by round, so a machine's drifting
load falls on all; medians are reported, as ratios to the free baseline of the same
run, with a JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bitserve.llm import LLMEngine, SamplingParams
from bitserve.llm.structured import Guide

ROOT = Path(__file__).resolve().parent.parent
# An output longer than --tokens, so guided rows stay in the batch as long as free ones
# (both stop at max_tokens): the comparison is per token, at the same batch size.
SCHEMA = {
    "type": "object",
    "properties": {
        "verses": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 1, "maximum": 176},
                    "word": {"type": "string", "maxLength": 8},
                },
                "required": ["n", "word"],
                "additionalProperties": False,
            },
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["verses"],
    "additionalProperties": False,
}


def run(engine: LLMEngine, guided: list[bool], tokens: int) -> dict:
    """One batch: tok/s over all rows, and the free rows' mean TPOT."""
    started = time.perf_counter()
    for i, g in enumerate(guided):
        params = SamplingParams(
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=not g,
            guide=Guide.json_schema(SCHEMA) if g else None,
        )
        engine.add_request(f"r{i}-{started}", "In the beginning", params)
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            counts[out.request_id] = n
            if out.finished:
                done[out.request_id] = now
    seconds = time.perf_counter() - started
    free = [
        r
        for i, r in enumerate(sorted(first, key=lambda r: int(r[1:].split("-")[0])))
        if not guided[i]
    ]
    tpot = [(done[r] - first[r]) / max(counts[r] - 1, 1) for r in free]
    return {
        "tok_s": sum(counts.values()) / seconds,
        "free_tpot": statistics.mean(tpot) if tpot else 0.0,
        "tokens": sum(counts.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument(
        "--model", type=Path, default=ROOT / "models" / "tinylm" / "1", help="an LLM folder"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(args.model, guided_max_string=32)
    variants = {
        "free x16": [False] * 16,
        "json x16": [True] * 16,
        "json x8 + free x8": [True] * 8 + [False] * 8,
    }
    run(engine, [True, False], 16)  # warm-up: compile the grammar, the kernels
    results: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.rounds):  # each round in another order: drift hits all alike
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            results[name].append(run(engine, variants[name], args.tokens))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    base = med["free x16"]
    print(f"{'variant':<20} {'tok/s':>8} {'vs free':>8} {'free TPOT ms':>13} {'vs free':>8}")
    for name, m in med.items():
        tpot = m["free_tpot"] * 1000
        tpot_ratio = m["free_tpot"] / base["free_tpot"] if m["free_tpot"] else float("nan")
        ratio = m["tok_s"] / base["tok_s"]
        print(f"{name:<20} {m['tok_s']:8.1f} {ratio:8.3f} {tpot:13.2f} {tpot_ratio:8.3f}")
    summary = {
        "json_tok_s_ratio": med["json x16"]["tok_s"] / base["tok_s"],
        "mixed_free_tpot_ratio": med["json x8 + free x8"]["free_tpot"] / base["free_tpot"],
        "rounds": args.rounds,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
