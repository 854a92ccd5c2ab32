"""Offline `bitserve batch` against the online server saturated by `bitserve bench`.

The same model (tinylm), the same prompts and max_tokens (ignore_eos, greedy): first
`bitserve serve` driven by `bitserve bench` at several concurrencies (its best output
tok/s is the baseline), then `bitserve batch` over the same requests as an OpenAI Batch
file, twice: with `--workers N` (default: one per CPU this process may use) and with
`--workers 1`. Prints a table and a JSON line; the goal is the best batch >= 1.2x the
online best.

The two batch rows answer different questions. Online runs one engine per model (an
engine steps on one core; the other cores serve HTTP and, here, the bench client), so
`--workers 1` against online is the like-for-like number: one engine each, batch without
the HTTP and admission costs. `--workers N` is what batch does with the machine: it has
no HTTP to serve, so it runs one engine per core (data parallelism over processes).

    .venv/bin/python -m bench.batch --requests 400 --concurrency 16,64,256 --workers 2
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from bench.server import ROOT, Server

WORDS = [
    "and",
    "the",
    "lord",
    "said",
    "unto",
    "moses",
    "in",
    "the",
    "beginning",
    "god",
    "created",
    "heaven",
    "earth",
]


def dataset(n: int, seed: int, input_words: int, output_len: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.randint(input_words // 2, input_words * 3 // 2)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        rows.append({"prompt": prompt, "output_len": rng.randint(output_len // 2, output_len)})
    return rows


def online(repo: Path, data: Path, n: int, concurrency: str, work: Path, model: str) -> dict:
    """`bitserve bench` against `bitserve serve`; its best point by output tok/s."""
    server = Server.bitserve(repo).start()
    try:
        command = [sys.executable, "-m", "bitserve.cli", "bench", server.url, "--model", model]
        command += ["--api", "completions", "--dataset", str(data), "--num-requests", str(n)]
        command += ["--concurrency", concurrency, "--ignore-eos", "--no-stream", "--no-plots"]
        command += ["--no-progress", "--report-dir", str(work / "online"), "--warmup", "8"]
        subprocess.run(command, check=True, capture_output=True, timeout=1800)
    finally:
        server.stop()
    points = json.loads((work / "online" / "result.json").read_text())["points"]
    served = [p for p in points if not p["failed"]] or points  # a point that 429s is not served
    return max(served, key=lambda p: p["output_throughput"])


def batch_file(rows: list[dict], path: Path, model: str) -> Path:
    """The same requests as an OpenAI Batch file."""
    with path.open("w") as f:
        for i, row in enumerate(rows):
            body = {"model": model, "prompt": row["prompt"], "max_tokens": row["output_len"]}
            body |= {"temperature": 0, "ignore_eos": True}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    return path


def offline(repo: Path, inp: Path, work: Path, workers: int) -> dict:
    """`bitserve batch --workers N` over the requests; output tok/s from its output file."""
    out = work / f"batch-{workers}.out.jsonl"
    command = [sys.executable, "-m", "bitserve.cli", "batch", "--repository", str(repo)]
    command += ["--input", str(inp), "--output", str(out), "--no-progress"]
    command += ["--workers", str(workers)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    # the summary's seconds: from models loaded to the last answer durable on disk
    seconds = float(re.search(r"in ([\d.]+) s", done.stderr).group(1))
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(d["response"]["body"]["usage"]["completion_tokens"] for d in docs)
    failed = sum(d["error"] is not None for d in docs)
    return {"workers": workers, "seconds": seconds, "request_throughput": len(docs) / seconds,
            "output_throughput": tokens / seconds, "failed": failed}  # fmt: skip


@click.command()
@click.option("--repository", type=click.Path(path_type=Path), default=ROOT / "models")
@click.option("--model", default="tinylm")
@click.option("--requests", "n", default=400, show_default=True)
@click.option("--concurrency", default="16,64,256", show_default=True)
@click.option("--input-words", default=24, show_default=True)
@click.option("--output-len", default=64, show_default=True)
@click.option("--seed", default=0)
@click.option(
    "--workers",
    default=len(os.sched_getaffinity(0)),
    show_default="the CPUs this process may use",
    help="bitserve batch --workers for the data-parallel row.",
)
def main(repository, model, n, concurrency, input_words, output_len, seed, workers) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = dataset(n, seed, input_words, output_len)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"  # only the model under test: serve loads all it finds
        shutil.copytree(repository / model, repo / model)
        data = work / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        best = online(repo, data, n, concurrency, work, model)
        inp = batch_file(rows, work / "batch.jsonl", model)
        batch = offline(repo, inp, work, workers)
        single = batch if workers == 1 else offline(repo, inp, work, 1)
    best.pop("samples", None)  # raw latencies: not needed in the one-line result
    ratio = batch["output_throughput"] / best["output_throughput"]
    ratio_single = single["output_throughput"] / best["output_throughput"]
    top = max((batch, single), key=lambda b: b["output_throughput"])
    print(f"{'':28}{'req/s':>10}{'out tok/s':>12}{'/ online':>10}")
    print(f"{'online best (' + str(best.get('load')) + ')':28}"
          f"{best['request_throughput']:>10.1f}{best['output_throughput']:>12.1f}")  # fmt: skip
    for row, r in ((batch, ratio), (single, ratio_single))[: 1 if workers == 1 else 2]:
        name = f"bitserve batch --workers {row['workers']}"
        print(f"{name:28}{row['request_throughput']:>10.1f}"
              f"{row['output_throughput']:>12.1f}{r:>9.2f}x")  # fmt: skip
    print(f"one engine each: batch --workers 1 / online = {ratio_single:.2f}x")
    print(f"best batch (--workers {top['workers']}) / online = "
          f"{max(ratio, ratio_single):.2f}x (goal >= 1.2x)")  # fmt: skip
    print(json.dumps({"bench": "batch", "model": model, "requests": n, "online": best,
                      "batch": batch, "ratio": ratio, "batch_single": single,
                      "ratio_single": ratio_single}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
