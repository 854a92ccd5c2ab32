"""Offline `bitserve batch` against the online server saturated by `bitserve bench`.

The same model (tinylm), the same prompts and max_tokens (ignore_eos, greedy): first
`bitserve serve` driven by `bitserve bench` at several concurrencies (its best output
tok/s is the baseline), then `bitserve batch` over the same requests as an OpenAI Batch
file. Prints a table and a JSON line; the goal is batch >= 1.2x the online best.

    .venv/bin/python bench/batch.py --requests 400 --concurrency 16,64,256
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import Server  # noqa: E402 - a real `bitserve serve`, as tests start it

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
    server = Server(repo)
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


def offline(repo: Path, rows: list[dict], work: Path, model: str) -> dict:
    """`bitserve batch` over the same requests; output tok/s from its output file."""
    inp, out = work / "batch.jsonl", work / "batch.out.jsonl"
    with inp.open("w") as f:
        for i, row in enumerate(rows):
            body = {"model": model, "prompt": row["prompt"], "max_tokens": row["output_len"]}
            body |= {"temperature": 0, "ignore_eos": True}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    command = [sys.executable, "-m", "bitserve.cli", "batch", "--repository", str(repo)]
    command += ["--input", str(inp), "--output", str(out), "--no-progress"]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    # the summary's seconds: from models loaded to the last answer durable on disk
    seconds = float(re.search(r"in ([\d.]+) s", done.stderr).group(1))
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(d["response"]["body"]["usage"]["completion_tokens"] for d in docs)
    failed = sum(d["error"] is not None for d in docs)
    return {"seconds": seconds, "request_throughput": len(docs) / seconds,
            "output_throughput": tokens / seconds, "failed": failed}  # fmt: skip


@click.command()
@click.option("--repository", type=click.Path(path_type=Path), default=ROOT / "models")
@click.option("--model", default="tinylm")
@click.option("--requests", "n", default=400, show_default=True)
@click.option("--concurrency", default="16,64,256", show_default=True)
@click.option("--input-words", default=24, show_default=True)
@click.option("--output-len", default=64, show_default=True)
@click.option("--seed", default=0)
def main(repository, model, n, concurrency, input_words, output_len, seed) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = dataset(n, seed, input_words, output_len)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"  # only the model under test: serve loads all it finds
        shutil.copytree(repository / model, repo / model)
        data = work / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        best = online(repo, data, n, concurrency, work, model)
        batch = offline(repo, rows, work, model)
    best.pop("samples", None)  # raw latencies: not needed in the one-line result
    ratio = batch["output_throughput"] / best["output_throughput"]
    print(f"{'':24}{'req/s':>10}{'out tok/s':>12}")
    print(f"{'online best (' + str(best.get('load')) + ')':24}"
          f"{best['request_throughput']:>10.1f}{best['output_throughput']:>12.1f}")  # fmt: skip
    print(f"{'bitserve batch':24}{batch['request_throughput']:>10.1f}"
          f"{batch['output_throughput']:>12.1f}")  # fmt: skip
    print(f"batch / online = {ratio:.2f}x (goal >= 1.2x)")
    print(json.dumps({"bench": "batch", "model": model, "requests": n, "online": best,
                      "batch": batch, "ratio": ratio}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
