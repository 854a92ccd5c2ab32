"""Dynamic batching benchmark: bitserve against its peers, on the same CPU, in one run.

    .venv-bench/bin/python -m bench.batching [--duration 5] [--only minilm,mlp,noop]
        [--concurrency 1,8,64] [--quick]

Every server runs as its own process pinned (with all its children) to the server core
and one torch/OMP/MKL thread; the load generator is pinned to the other core. Load is
`bitserve bench`'s closed loop (bitserve/loadtest/loadgen.py): N virtual clients, one
keep-alive connection each, each sending its next request when the previous one
answers, for a fixed duration per point. Compared:

- minilm: bitserve batched / unbatched, LitServe at its best settings, and the ceiling
  (the same computation in this process at batch 32, no HTTP at all);
- mlp: bitserve against a plain FastAPI endpoint;
- noop: bitserve's python backend echoing its input against a FastAPI echo;
- client: the load generator against servers that do nothing, to show it is not the limit.

Prints a table, the goal ratios (pass/fail) and a final JSON line, also written to
bench/results/batching.json. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.server import THREAD_ENV, Server, free_port
from bitserve.loadtest import loadgen, metrics
from bitserve.loadtest.client import build_request
from bitserve.loadtest.workloads import Request

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"
RESULTS = ROOT / "bench" / "results" / "batching.json"
# LitServe settings tried at the highest concurrency; the best (by req/s) is then measured
# at every concurrency. (max_batch_size, batch_timeout s, workers_per_device, fast_queue)
LITSERVE_GRID = [
    (32, 0.0, 1, False),
    (32, 0.005, 1, False),
    (32, 0.01, 1, False),
    (32, 0.005, 1, True),
    (32, 0.02, 1, True),
    (16, 0.005, 1, True),
    (32, 0.005, 2, True),
]
# Used without a sweep (--quick): best or within noise (±5%) of the best in our sweeps.
LITSERVE_DEFAULT = (32, 0.005, 1, False)

# Set by SIGINT/SIGTERM. Inside the event loop an exception from a signal handler can be
# swallowed (uvloop logs exceptions raised in protocol callbacks), so the loop polls this.
STOP = threading.Event()
CLIENT = "bitserve.loadtest"  # the load generator: bitserve/loadtest/loadgen.py


# ---------------------------------------------------------------- request bodies


def sentences(n: int = 512) -> list[str]:
    """Distinct short English sentences (~8-14 tokens), so no two requests repeat in a row."""
    # fmt: off
    subjects = ["The cat", "A small robot", "My neighbour", "The old train", "Every student",
                "The river", "A quiet engineer", "The market"]
    verbs = ["watches", "repairs", "remembers", "follows", "paints", "measures", "ignores",
             "describes"]
    objects = ["the morning light", "a broken bicycle", "the distant hills", "an empty cup",
               "the busy harbour", "a long letter", "the winter garden", "a tired dog"]
    tails = ["before dinner.", "in the rain.", "without a word.", "every Sunday.",
             "near the station.", "with great care.", "after the storm.", "for no reason."]
    # fmt: on
    out = [f"{s} {v} {o} {t}" for s in subjects for v in verbs for o in objects for t in tails]
    rng = np.random.default_rng(0)
    return [out[i] for i in rng.permutation(len(out))[:n]]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def v2_body(name: str, datatype: str, shape: list[int], data: list) -> bytes:
    return dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]})


def float_rows(n: int, width: int) -> list[list[float]]:
    rng = np.random.default_rng(1)
    return [[round(float(v), 6) for v in rng.standard_normal(width)] for _ in range(n)]


# ---------------------------------------------------------------- load generator
# The closed loop itself is `bitserve bench`'s (bitserve/loadtest/loadgen.py): N virtual
# clients on raw-asyncio keep-alive connections. This script only adds CPU accounting.


def cpu_times() -> dict[int, tuple[int, int]]:
    """Per-CPU (busy, total) jiffies from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                v = [int(x) for x in vals]
                idle = v[3] + v[4]
                out[int(name[3:])] = (sum(v[:8]) - idle, sum(v[:8]))
    return out


def cpu_busy(before: dict, after: dict, cpus: set[int]) -> float:
    """Average busy fraction of `cpus` between two `cpu_times` snapshots."""
    busy = sum(after[c][0] - before[c][0] for c in cpus)
    total = sum(after[c][1] - before[c][1] for c in cpus)
    return busy / total if total else 0.0


@dataclass
class Target:
    """Where and what to send: one server endpoint and its pre-encoded request bodies."""

    port: int
    path: str
    bodies: list[bytes]
    stats_path: str | None = None  # bitserve's per-model batch statistics, if any


def measure(target: Target, concurrency: int, warmup: float, duration: float, cfg) -> dict:
    """One closed-loop point with `bitserve bench`'s load generator: warm up, measure
    `duration` seconds, summarise with CPU use of the client and the server cores."""
    host = f"127.0.0.1:{target.port}"
    url = f"http://{host}"
    requests = [Request(build_request(host, target.path, b)) for b in target.bodies]
    if warmup > 0:
        loadgen.run(url, requests, loadgen.Load(concurrency=concurrency, duration=warmup))
    before = (cpu_times(), os.times())
    run = loadgen.run(url, requests, loadgen.Load(concurrency=concurrency, duration=duration))
    after = (cpu_times(), os.times())
    if STOP.is_set():
        raise KeyboardInterrupt
    return summarise(run, concurrency, before, after, cfg)


def summarise(run: loadgen.Run, concurrency: int, before: tuple, after: tuple, cfg) -> dict:
    """The row of the table: bitserve bench's metrics plus the CPU each side used."""
    s = metrics.summarise(run)
    (cpu_a, os_a), (cpu_b, os_b) = before, after
    client_cpu = ((os_b.user + os_b.system) - (os_a.user + os_a.system)) / max(
        os_b.elapsed - os_a.elapsed, 1e-9
    )
    lost = s["errors"].get("connection", 0)
    e2e = s["e2el"]
    return {
        "concurrency": concurrency,
        "requests": s["completed"],
        "errors": s["failed"] - lost,
        "lost_connections": lost,
        "seconds": round(run.duration, 3),
        "rps": round(s["request_throughput"], 1),
        "p50_ms": _round(e2e["median_ms"]),
        "p99_ms": _round(e2e["p99_ms"]),
        "mean_ms": _round(e2e["mean_ms"]),
        "client_cpu": round(client_cpu, 2),
        "server_cpu": round(cpu_busy(cpu_a, cpu_b, cfg.server_cpus), 2),
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


# ---------------------------------------------------------------- servers


def http_post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def bench_server(server: Server, target: Target, cfg, concurrencies: list[int]) -> list[dict]:
    """Start, probe once, warm up at the highest concurrency, measure each point, stop."""
    with server:
        status, body = http_post(target.port, target.path, target.bodies[0])
        if status != 200:
            raise RuntimeError(
                f"{server.name}: probe answered {status}: {body[:300]!r}\n{server.tail()}"
            )
        measure(target, max(concurrencies), 0.0, cfg.warmup, cfg)
        points = []
        for c in concurrencies:
            before = batch_counts(target)
            point = measure(target, c, cfg.warmup, cfg.duration, cfg)
            point["mean_batch"] = mean_batch(before, batch_counts(target))
            progress(
                f"  {server.name[:40]:<40} c={c:<3} {point['rps']:>9.1f} req/s "
                f"p50 {point['p50_ms']} ms p99 {point['p99_ms']} ms "
                f"batch {point['mean_batch']}"
            )
            points.append(point)
        return points


def batch_counts(target: Target) -> tuple[int, int] | None:
    """(rows, executions) so far from bitserve's stats: their ratio is the mean batch size."""
    if target.stats_path is None:
        return None
    conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=5)
    try:
        conn.request("GET", target.stats_path)
        stats = json.loads(conn.getresponse().read())["model_stats"]
        rows = sum(s["inference_count"] for s in stats)
        return rows, sum(s["execution_count"] for s in stats)
    except (OSError, ValueError, KeyError):
        return None
    finally:
        conn.close()


def mean_batch(before: tuple | None, after: tuple | None) -> float | None:
    """Rows per execution between two `batch_counts` (warm-up included), or None."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 2)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- model repositories


def bitserve_cmd(cfg, repo: Path, port: int) -> list[str]:
    return [
        cfg.bitserve,
        "serve",
        "--repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        "0",
    ]


def strip_table(config_text: str, table: str) -> str:
    """`config_text` without `[table]` (and its sub-tables): a TOML edit without a writer."""
    out, skipping = [], False
    for line in config_text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            name = stripped.strip("[]").strip().strip('"')
            skipping = name == table or name.startswith(table + ".")
        if not skipping:
            out.append(line)
    text = "".join(out)
    if table in tomllib.loads(text):
        raise ValueError(f"could not remove [{table}] from the config")
    return text


def copy_model(src: Path, repo: Path, config_text: str | None = None) -> Path:
    """A model folder in `repo`: its own config.toml, the rest (version folders) symlinked."""
    dst = repo / src.name
    dst.mkdir(parents=True)
    (dst / "config.toml").write_text(config_text or (src / "config.toml").read_text())
    for entry in src.iterdir():
        if entry.name != "config.toml":
            (dst / entry.name).symlink_to(entry.resolve())
    return dst


NOOP_CONFIG = """\
backend = "python"
max_batch_size = 64

[[input]]
name = "x"
datatype = "FP32"
dims = [4]

[[output]]
name = "y"
datatype = "FP32"
dims = [4]

[dynamic_batching]
"""
NOOP_MODEL = """\
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"]}
"""
MLP_CONFIG = """\
backend = "torch"
max_batch_size = 64

[[input]]
name = "x"
datatype = "FP32"
dims = [512]

[[output]]
name = "y"
datatype = "FP32"
dims = [512]

[dynamic_batching]
"""


def noop_repo(repo: Path) -> None:
    (repo / "noop" / "1").mkdir(parents=True)
    (repo / "noop" / "config.toml").write_text(NOOP_CONFIG)
    (repo / "noop" / "1" / "model.py").write_text(NOOP_MODEL)


def mlp_repo(repo: Path) -> str:
    """models/mlp once tools/build_models.py has built it, else the same MLP exported here."""
    src = ROOT / "models" / "mlp"
    if (src / "1" / "model.pt2").exists():
        copy_model(src, repo)
        return "models/mlp"
    import torch

    from bench.peers.fastapi_mlp import build_mlp

    config = (src / "config.toml").read_text() if (src / "config.toml").exists() else MLP_CONFIG
    (repo / "mlp" / "1").mkdir(parents=True)
    (repo / "mlp" / "config.toml").write_text(config)
    example = (torch.randn(4, 512),)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(build_mlp(), example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(repo / "mlp" / "1" / "model.pt2"))
    return "models/mlp config, model.pt2 exported here (tools/build_models.py output missing)"


# ---------------------------------------------------------------- suites


def run_case(results: dict, model: str, label: str, make, cfg, concurrencies=None) -> list[dict]:
    """Benchmark one server; a server that fails is reported and the run goes on."""
    try:
        server, target = make()
        points = bench_server(server, target, cfg, concurrencies or cfg.concurrency)
    except Exception as e:  # a benchmark reports a broken server and goes on
        progress(f"  {label}: FAILED: {e}")
        results["failures"].append({"model": model, "server": label, "error": str(e)[-2000:]})
        return []
    if concurrencies is None:
        results["rows"].extend({"model": model, "server": label, **p} for p in points)
    return points


def pick_best(cfg, results: dict, model: str, label: str, candidates: list, make) -> Any:
    """Try each candidate setting at the highest concurrency; keep the fastest (req/s)."""
    if not cfg.sweep or len(candidates) == 1:
        return candidates[0]
    hi, tried = max(cfg.concurrency), []
    short = argparse.Namespace(**{**vars(cfg), "duration": cfg.sweep_duration})
    for cand in candidates:
        points = run_case(results, model, f"{label} {cand}", lambda c=cand: make(c), short, [hi])
        if points:
            tried.append({"setting": cand, **points[0]})
    results["sweeps"][label] = tried
    if not tried:
        return candidates[0]
    return max(tried, key=lambda t: t["rps"])["setting"]


def pinned(cfg, name: str, cmd: list[str], port: int, ready: str) -> Server:
    """A server under test, pinned to the server core(s) with the run's thread count."""
    return Server(
        name, cmd, port, ready, cpus=cfg.server_cpus, threads=cfg.threads, timeout=cfg.ready_timeout
    )


def peer(cfg, script: str, args: list[str], path: str, bodies: list[bytes], ready: str):
    port = free_port()
    cmd = [sys.executable, str(PEERS / script), "--port", str(port), *args]
    name = " ".join([script.removesuffix(".py"), *args]).replace("--", "")
    return pinned(cfg, name, cmd, port, ready), Target(port, path, bodies)


def bitserve(cfg, label: str, repo: Path, model: str, bodies: list[bytes]):
    if not Path(cfg.bitserve).exists():
        raise RuntimeError(f"bitserve executable not found: {cfg.bitserve}")
    port = free_port()
    server = pinned(cfg, label, bitserve_cmd(cfg, repo, port), port, "/v2/health/ready")
    return server, Target(port, f"/v2/models/{model}/infer", bodies, f"/v2/models/{model}/stats")


def litserve_args(setting: tuple) -> list[str]:
    mbs, timeout, workers, fast = setting
    args = [
        "--max-batch-size",
        str(mbs),
        "--batch-timeout",
        str(timeout),
        "--workers",
        str(workers),
    ]
    return [*args, "--fast-queue"] if fast else args


def suite_minilm(cfg, results: dict) -> None:
    progress("minilm: all-MiniLM-L6-v2, one sentence per request")
    texts = sentences()
    v2 = [v2_body("text", "BYTES", [1, 1], [t]) for t in texts]
    lit = [dumps({"text": t}) for t in texts]
    src = ROOT / "models" / "minilm"
    with tempfile.TemporaryDirectory(prefix="bench-minilm-") as tmp:
        if (src / "config.toml").exists():
            batched, unbatched = Path(tmp) / "batched", Path(tmp) / "unbatched"
            copy_model(src, batched)
            text = (src / "config.toml").read_text()
            copy_model(src, unbatched, strip_table(text, "dynamic_batching"))
            for label, repo in (("bitserve", batched), ("bitserve-nobatch", unbatched)):
                run_case(
                    results,
                    "minilm",
                    label,
                    lambda r=repo, lb=label: bitserve(cfg, lb, r, "minilm", v2),
                    cfg,
                )
        else:
            results["failures"].append(
                {"model": "minilm", "server": "bitserve", "error": f"{src}/config.toml is missing"}
            )
    grid = LITSERVE_GRID if cfg.sweep else [LITSERVE_DEFAULT]
    best = pick_best(
        cfg,
        results,
        "minilm",
        "litserve",
        grid,
        lambda s: peer(cfg, "litserve_minilm.py", litserve_args(s), "/predict", lit, "/health"),
    )
    results["settings"]["litserve"] = dict(
        zip(
            ("max_batch_size", "batch_timeout_s", "workers_per_device", "fast_queue"),
            best,
            strict=True,
        )
    )
    run_case(
        results,
        "minilm",
        "litserve",
        lambda: peer(cfg, "litserve_minilm.py", litserve_args(best), "/predict", lit, "/health"),
        cfg,
    )
    results["ceiling"] = inprocess_ceiling(cfg, texts)


def inprocess_ceiling(cfg, texts: list[str], batch: int = 32) -> dict:
    """The same MiniLM computation in this process, on the server core: no HTTP, no queue.

    Batch 32 is the ceiling a batching server can approach; batch 1 is what a server that
    runs requests one by one can reach, so their ratio is all that batching can give here.
    """
    from bench.peers.minilm_model import MiniLM

    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cfg.server_cpus)
    try:
        model = MiniLM(threads=int(os.environ["OMP_NUM_THREADS"]))
        full = sentences_per_second(model, texts, batch, cfg.duration)
        single = sentences_per_second(model, texts, 1, cfg.duration)
    finally:
        os.sched_setaffinity(0, saved)
    result = {
        "batch": batch,
        "sentences_per_s": full,
        "batch_ms": round(batch / full * 1e3, 2),
        "batch1_sentences_per_s": single,
        "batch1_ms": round(1 / single * 1e3, 2),
    }
    progress(f"  in-process ceiling: batch {batch} {full} sentences/s, batch 1 {single}")
    return result


def sentences_per_second(model, texts: list[str], batch: int, seconds: float) -> float:
    batches = [texts[i : i + batch] for i in range(0, len(texts) - batch + 1, batch)]
    for b in batches[:2]:
        model.embed(b)  # warm-up: first calls allocate
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.embed(batches[n % len(batches)])
        n += 1
    return round(n * batch / (time.perf_counter() - start), 1)


def suite_mlp(cfg, results: dict) -> None:
    progress("mlp: 512-1024-1024-512 ReLU, FP32, one row per request")
    rows = float_rows(64, 512)
    v2 = [v2_body("x", "FP32", [1, 512], r) for r in rows]
    plain = [dumps({"x": r}) for r in rows]
    with tempfile.TemporaryDirectory(prefix="bench-mlp-") as tmp:
        try:
            results["settings"]["mlp_model"] = mlp_repo(Path(tmp))
        except Exception as e:  # the export itself: report it, keep the peers
            results["failures"].append({"model": "mlp", "server": "bitserve", "error": repr(e)})
        else:
            run_case(
                results,
                "mlp",
                "bitserve",
                lambda: bitserve(cfg, "bitserve", Path(tmp), "mlp", v2),
                cfg,
            )
    make = lambda mode: peer(cfg, "fastapi_mlp.py", ["--mode", mode], "/predict", plain, "/health")  # noqa: E731
    mode = pick_best(cfg, results, "mlp", "fastapi-mlp", ["async", "sync"], make)
    results["settings"]["fastapi_mlp_mode"] = mode
    run_case(results, "mlp", "fastapi", lambda: make(mode), cfg)


def suite_noop(cfg, results: dict) -> None:
    progress("noop: python backend echoing x FP32 [4]")
    rows = float_rows(64, 4)
    v2 = [v2_body("x", "FP32", [1, 4], r) for r in rows]
    plain = [dumps({"x": r}) for r in rows]
    with tempfile.TemporaryDirectory(prefix="bench-noop-") as tmp:
        noop_repo(Path(tmp))
        run_case(
            results,
            "noop",
            "bitserve",
            lambda: bitserve(cfg, "bitserve", Path(tmp), "noop", v2),
            cfg,
        )
    make = lambda mode: peer(cfg, "fastapi_echo.py", ["--mode", mode], "/predict", plain, "/health")  # noqa: E731
    mode = pick_best(cfg, results, "noop", "fastapi-echo", ["async", "sync"], make)
    results["settings"]["fastapi_echo_mode"] = mode
    run_case(results, "noop", "fastapi", lambda: make(mode), cfg)


def suite_client(cfg, results: dict) -> None:
    """How fast each load generator goes against servers that do nothing."""
    progress("client: load generators against do-nothing servers")
    hi = max(cfg.concurrency)
    bodies = [dumps({"x": r}) for r in float_rows(64, 4)]
    for kind in ("canned", "asgi"):
        server, target = peer(cfg, "trivial_http.py", ["--kind", kind], "/", bodies, "/")
        with server:
            for client in (CLIENT,):
                point = measure(target, hi, cfg.warmup, cfg.duration, cfg)
                progress(
                    f"  {client:<8} -> {kind:<7} c={hi}: {point['rps']:>9.1f} req/s, "
                    f"client cpu {point['client_cpu']:.2f}, server cpu {point['server_cpu']:.2f}"
                )
                results["client_check"].append({"client": client, "server": kind, **point})


# ---------------------------------------------------------------- goals and report


def find(results: dict, model: str, server: str, c: int) -> dict | None:
    return next(
        (
            r
            for r in results["rows"]
            if (r["model"], r["server"], r["concurrency"]) == (model, server, c)
        ),
        None,
    )


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def goals(results: dict, cfg) -> list[dict]:
    """The targets of this benchmark, computed from this run's numbers only."""
    hi, lo = max(cfg.concurrency), min(cfg.concurrency)
    b_hi, u_hi = (
        find(results, "minilm", "bitserve", hi),
        find(results, "minilm", "bitserve-nobatch", hi),
    )
    l_hi = find(results, "minilm", "litserve", hi)
    b_lo, u_lo = (
        find(results, "minilm", "bitserve", lo),
        find(results, "minilm", "bitserve-nobatch", lo),
    )
    ceiling = results.get("ceiling") or {}
    to_ceiling = b_hi["rps"] / ceiling["sentences_per_s"] if b_hi and ceiling else None
    gain = ceiling["sentences_per_s"] / ceiling["batch1_sentences_per_s"] if ceiling else None
    client_max = max(
        (
            p["rps"]
            for p in results["client_check"]
            if p["client"] == CLIENT and p["server"] == "canned"
        ),
        default=None,
    )
    noop_max = max((r["rps"] for r in results["rows"] if r["model"] == "noop"), default=None)
    headroom = client_max / noop_max if client_max and noop_max else None
    checks = [
        (f"minilm c={hi}: batched / unbatched req/s", ratio(b_hi, u_hi, "rps"), ">=", 3.0),
        (f"minilm c={hi}: batched / LitServe req/s", ratio(b_hi, l_hi, "rps"), ">=", 1.2),
        (f"minilm c={hi}: batched req/s / in-process ceiling", to_ceiling, ">=", 0.9),
        (f"minilm c={hi}: batched p99 / LitServe p99", ratio(b_hi, l_hi, "p99_ms"), "<", 1.0),
        (f"minilm c={lo}: batched p50 / unbatched p50", ratio(b_lo, u_lo, "p50_ms"), "<=", 1.1),
        (
            f"noop c={hi}: bitserve / FastAPI req/s",
            ratio(
                find(results, "noop", "bitserve", hi), find(results, "noop", "fastapi", hi), "rps"
            ),
            ">=",
            0.8,
        ),
        (
            f"mlp c={hi}: bitserve / FastAPI req/s (reported)",
            ratio(find(results, "mlp", "bitserve", hi), find(results, "mlp", "fastapi", hi), "rps"),
            None,
            None,
        ),
        ("load generator: req/s vs do-nothing server / best noop req/s", headroom, ">=", 1.5),
        ("minilm in-process: batch 32 / batch 1 sentences/s (reported)", gain, None, None),
    ]
    return [goal(*c) for c in checks]


def goal(name: str, value: float | None, op: str | None, threshold: float | None) -> dict:
    if value is None:
        status = "n/a"
    elif op is None:
        status = "info"
    else:
        ok = {">=": value >= threshold, "<": value < threshold, "<=": value <= threshold}[op]
        status = "pass" if ok else "fail"
    value = round(value, 3) if value is not None else None
    return {"goal": name, "value": value, "op": op, "threshold": threshold, "status": status}


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(results: dict) -> None:
    """The human-readable part of stdout: the table, side measurements, then the goals."""
    print_table(results["rows"])
    print_side(results)
    print()
    for g in results["goals"]:
        target = f"{g['op']} {g['threshold']}" if g["op"] else ""
        print(f"[{g['status']:>4}] {g['goal']:<62} {fmt(g['value'], '.3f'):>8} {target}")


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<7} {'server':<17} {'c':>3} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'errors':>6} {'batch':>6} {'cli cpu':>7} {'srv cpu':>7}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<7} {r['server']:<17} {r['concurrency']:>3} {r['rps']:>9.1f} "
            f"{fmt(r['p50_ms'], '9.2f')} {fmt(r['p99_ms'], '9.2f')} "
            f"{r['errors'] + r['lost_connections']:>6} {fmt(r.get('mean_batch'), '6.1f')} "
            f"{r['client_cpu']:>7.2f} {r['server_cpu']:>7.2f}"
        )


def print_side(results: dict) -> None:
    m = results["meta"]
    load = ", ".join(f"{k} {m.get(k, ['-'])[0]:.2f}" for k in ("loadavg_before", "loadavg_after"))
    print(
        f"\n1-min load average: {load} (servers pinned to {m['server_cpus']}, client to "
        f"{m['client_cpus']}; other work on the box skews the numbers)"
    )
    if results.get("ceiling"):
        c = results["ceiling"]
        print(
            f"\nminilm in-process ceiling: batch {c['batch']} {c['sentences_per_s']} sentences/s "
            f"({c['batch_ms']} ms/batch); batch 1 {c['batch1_sentences_per_s']} sentences/s"
        )
    for p in results["client_check"]:
        print(
            f"client {p['client']:<8} -> {p['server']:<7} c={p['concurrency']}: "
            f"{p['rps']:.1f} req/s, client cpu {p['client_cpu']:.2f}, "
            f"server cpu {p['server_cpu']:.2f}"
        )
    for label, tried in results["sweeps"].items():
        for t in tried:
            print(
                f"sweep {label:<13} {t['setting']!s:<26} {t['rps']:>9.1f} req/s  "
                f"p99 {fmt(t['p99_ms'], '.1f')} ms"
            )
    print(f"settings: {json.dumps(results['settings'])}")
    for f in results["failures"]:
        first = f["error"].splitlines()[0] if f["error"] else ""
        print(f"FAILED {f['model']} {f['server']}: {first}")


# ---------------------------------------------------------------- main


def cpu_list(text: str) -> set[int]:
    return {int(x) for x in text.split(",") if x.strip()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cpus = sorted(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each point")
    p.add_argument(
        "--only", default="client,minilm,mlp,noop", help="comma list of suites: " + ",".join(SUITES)
    )
    p.add_argument("--concurrency", default="1,8,64", help="virtual clients per point")
    p.add_argument("--quick", action="store_true", help="2 s points, no settings sweep")
    p.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="skip trying LitServe/FastAPI settings; use the defaults",
    )
    p.add_argument("--sweep-duration", type=float, default=3.0, help="seconds per sweep point")
    p.add_argument(
        "--threads", type=int, default=1, help="torch/OMP threads of every server (and ceiling)"
    )
    p.add_argument("--server-cpus", type=cpu_list, default={cpus[-1]}, help="e.g. 1")
    p.add_argument("--client-cpus", type=cpu_list, default=set(cpus[:-1]) or {cpus[0]})
    p.add_argument("--bitserve", default=str(default_bitserve()), help="bitserve executable")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for ready")
    p.add_argument("--out", type=Path, default=RESULTS)
    cfg = p.parse_args(argv)
    cfg.concurrency = [int(c) for c in cfg.concurrency.split(",")]
    cfg.only = [s.strip() for s in cfg.only.split(",")]
    if unknown := set(cfg.only) - set(SUITES):
        p.error(f"--only: unknown suites {sorted(unknown)}; choose from {','.join(SUITES)}")
    if cfg.quick:
        cfg.duration, cfg.warmup, cfg.sweep = min(cfg.duration, 2.0), 0.5, False
    if cfg.server_cpus & cfg.client_cpus:
        progress("warning: server and client share a CPU; results will understate servers")
    return cfg


def default_bitserve() -> Path:
    """The project's .venv first (what `make` builds), else the one beside this Python."""
    main = ROOT / ".venv" / "bin" / "bitserve"
    return main if main.exists() else Path(sys.executable).parent / "bitserve"


def meta(cfg) -> dict:
    import torch

    def version(name: str) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_before": os.getloadavg(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "server_cpus": sorted(cfg.server_cpus),
        "client_cpus": sorted(cfg.client_cpus),
        "client": CLIENT,
        "duration_s": cfg.duration,
        "warmup_s": cfg.warmup,
        "concurrency": cfg.concurrency,
        "versions": {
            n: version(n)
            for n in ("bitserve", "litserve", "fastapi", "uvicorn", "transformers", "aiohttp")
        }
        | {"torch": torch.__version__},
    }


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def on_signal(signum, frame):
    """Ctrl-C and SIGTERM stop the run; the `with Server` blocks stop every server started.

    Outside the event loop this raises at once; inside it (where uvloop may swallow the
    exception) the point runs to its end, at most --duration, and `measure` raises then.
    """
    STOP.set()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None


SUITES = {"client": suite_client, "minilm": suite_minilm, "mlp": suite_mlp, "noop": suite_noop}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    # this process too: the ceiling runs torch here
    os.environ.update(THREAD_ENV, **{k: str(cfg.threads) for k in threads})
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    os.sched_setaffinity(0, cfg.client_cpus)
    if os.getloadavg()[0] > 0.5:
        progress(
            f"warning: load average {os.getloadavg()[0]:.2f} before start: other work on "
            "this machine will take CPU from the servers and skew the numbers"
        )
    results: dict[str, Any] = {
        "meta": meta(cfg),
        "rows": [],
        "client_check": [],
        "sweeps": {},
        "settings": {},
        "ceiling": None,
        "failures": [],
    }
    try:
        for name, suite in SUITES.items():
            if name in cfg.only:
                suite(cfg, results)
    except KeyboardInterrupt:
        progress("interrupted: every server started has been stopped; no results written")
        return 130
    results["goals"] = goals(results, cfg)
    results["meta"]["loadavg_after"] = os.getloadavg()
    report(results)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
