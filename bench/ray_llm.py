"""LLM data-parallel replicas on Ray: 2 replicas against 1, same server, same load.

    /work/main/.venv/bin/python -m bench.ray_llm [--rounds 3] [--streams 32] [--tokens 64]
        [--size 58m|246m] [--words 100]

One `bitserve serve --ray local` (a private Ray of 2 CPUs) holds two models over the
same random-weight Llama with a 384-piece tokenizer, built here (nothing is
downloaded): `--size 58m` (hidden 512, 8 layers) or `246m` (bench/llm_serving.py's
shape, hidden 1024, 16 layers, GQA 16/4; about 180M parameters with this vocabulary),
"one" with 1 replica and "two" with 2, each replica one torch thread. The 246m shape
is the honest one for this box: its engine step dominates the per-token work that
is not the model's (Ray messages, SSE, and the load generator, all on the same 2
cores); with 58m those are a large share of every token. Rounds alternate one / two
(A/B interleaved in one run, so box noise hits both); each round is 32 concurrent
streamed completions x 2 waves, `--words`-word prompts, `--tokens` output tokens with
ignore_eos. Reported per model: output
tok/s and TTFT p99 (median over rounds, with min-max spread), and the ratio of the
medians. Issue #34's goal: two >= 1.7x one's tok/s with a TTFT p99 no worse. The load
average of the box is printed before and after: it is shared.

Where the CPU goes: each round prints the CPU milliseconds per generated token of the
server process (the front door: HTTP, SSE chunks, routing, Ray messages), of this
load generator, of the replica actors (all of them, the idle model's too), and of
everything else on the box (Ray's own processes, other users), read from /proc; and
how many cores the replicas got (their CPU seconds over the round's wall time): two
replicas can only double one's tok/s if they get two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

CONFIG = """
backend = "llm"
[instance_group]
isolation = "ray"
count = {count}
num_cpus = 0.5
threads = 1
[parameters]
max_model_len = 512
max_num_seqs = 64
num_kv_blocks = 512
"""
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "a"]
WORDS += ["paged", "kv", "cache", "block"]


SIZES = {
    "58m": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
    "246m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}


def build(root: Path, size: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.llm.conftest import COMMON, build_tokenizer

    folder = root / "one" / "1"
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    config = LlamaConfig(**SIZES[size], **COMMON)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (root / "two").mkdir()
    (root / "two" / "1").symlink_to(folder)
    for name, count in (("one", 1), ("two", 2)):
        (root / name / "config.toml").write_text(CONFIG.format(count=count))


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    sent, first, count = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                assert "error" not in doc, doc
                if doc["choices"][0]["text"] or doc["choices"][0]["finish_reason"]:
                    first = first or time.perf_counter()
                    count += 1
    return first - sent, count


def replica_pids() -> list[int]:
    """The LLM replica actors' processes (Ray names them ray::LLMReplicaActor...)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"LLMReplicaActor" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def replicas_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # gone
            total += cpu_seconds(pid)
    return total


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of the whole box (pid None)."""
    tick = os.sysconf("SC_CLK_TCK")
    if pid is None:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        idle = int(fields[3]) + int(fields[4])
        return (sum(map(int, fields[:8])) - idle) / tick
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick


async def round_(
    url: str, model: str, streams: int, tokens: int, rng: random.Random, words: int, pid: int
) -> dict:
    prompts = [" ".join(rng.choices(WORDS, k=words)) for _ in range(2 * streams)]
    actors = replica_pids()
    cpu = (cpu_seconds(pid), time.process_time(), cpu_seconds(), replicas_cpu(actors))
    queue = list(prompts)
    ttfts: list[float] = []
    generated = 0

    async def worker(client):
        nonlocal generated
        while queue:
            ttft, n = await one_stream(client, url, model, queue.pop(), tokens)
            ttfts.append(ttft)
            generated += n

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(streams)))
    elapsed = time.perf_counter() - started
    server = cpu_seconds(pid) - cpu[0]
    client = time.process_time() - cpu[1]
    replicas = replicas_cpu(actors) - cpu[3]
    rest = cpu_seconds() - cpu[2] - server - client - replicas
    ttfts.sort()
    spent = (("server", server), ("client", client), ("replicas", replicas))
    per_token = {k: 1000 * v / generated for k, v in spent}
    return {
        "tok_s": generated / elapsed,
        "ttft_p99": ttfts[int(0.99 * (len(ttfts) - 1))],
        "cpu_ms_per_token": per_token | {"rest": 1000 * rest / generated},
        "replica_cores": replicas / elapsed,  # how much CPU the replicas got
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", choices=sorted(SIZES), default="58m")
    parser.add_argument("--words", type=int, default=100, help="prompt length in words")
    args = parser.parse_args()
    from tests.conftest import Server

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if "model name" in line), "?")
    print(f"{args}; CPU {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        build(root, args.size)
        server = Server(root, "--ray", "local")
        pid = server.process.pid
        try:
            rng = random.Random(0)
            for model in ("one", "two"):  # warm-up round, not counted
                asyncio.run(round_(server.url, model, args.streams, 8, rng, args.words, pid))
            results: dict[str, list[dict]] = {"one": [], "two": []}
            for i in range(args.rounds):
                for model in ("one", "two") if i % 2 == 0 else ("two", "one"):
                    r = asyncio.run(
                        round_(server.url, model, args.streams, args.tokens, rng, args.words, pid)
                    )
                    results[model].append(r)
                    cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items())
                    print(
                        f"round {i} {model}: {r['tok_s']:.1f} tok/s, TTFT p99 "
                        f"{r['ttft_p99']:.2f} s; CPU ms per token: {cpu}; "
                        f"the replicas used {r['replica_cores']:.2f} cores",
                        flush=True,
                    )
        finally:
            server.stop()
    load_after = os.getloadavg()
    summary = {}
    for model, rows in results.items():
        tok = [r["tok_s"] for r in rows]
        ttft = [r["ttft_p99"] for r in rows]
        summary[model] = {
            "tok_s": statistics.median(tok),
            "tok_s_spread": [min(tok), max(tok)],
            "ttft_p99_s": statistics.median(ttft),
            "ttft_p99_spread": [min(ttft), max(ttft)],
            "cpu_ms_per_token": {
                k: statistics.median(r["cpu_ms_per_token"][k] for r in rows)
                for k in rows[0]["cpu_ms_per_token"]
            },
            "replica_cores": statistics.median(r["replica_cores"] for r in rows),
        }
        print(
            f"{model}: {summary[model]['tok_s']:.1f} tok/s ({min(tok):.1f}-{max(tok):.1f}), "
            f"TTFT p99 {summary[model]['ttft_p99_s']:.2f} s ({min(ttft):.2f}-{max(ttft):.2f})"
        )
    speedup = summary["two"]["tok_s"] / summary["one"]["tok_s"]
    ttft_ok = summary["two"]["ttft_p99_s"] <= summary["one"]["ttft_p99_s"]
    print(f"two / one tok/s: {speedup:.2f}x (goal >= 1.7x); TTFT p99 no worse: {ttft_ok}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (2 cores)")
    summary |= {"speedup": speedup, "ttft_no_worse": ttft_ok, "load": [load_before, load_after]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
