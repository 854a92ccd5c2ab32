"""Diffusion benchmark: classifier-free guidance batched, and step-level batching
against one request at a time, on the same CPU, in one run.

    .venv/bin/python -m bench.diffusion [--clients 16] [--requests 2] [--rounds 3]
        [--steps 30] [--rows 1,4,8,16,32] [--threads 1]

(a) CFG cost, in process: at R rows, one guided step (the conditional and unconditional
    halves as one batch sharing one encoder pass: Denoiser.guided) against two separate
    passes (conditional, then unconditional) and against one unguided pass.
    Then one image alone as a plain denoise-update loop against the engine with
    max_rows = 1, to show that (b)'s baseline pays no overhead a plain loop would not.
(b) Serving, over HTTP (v2 infer, one keep-alive connection per client): a real
    `bitserve serve` with two copies of models/digits: `digits` (step-level batching,
    every request's rows in each step) and `digits_serial` (the same engine with
    max_rows = 1: one request runs its steps to the end before the next starts, as a
    diffusers pipeline behind a lock does; its CFG halves are still one batch).
    N clients, each sending its next request when the previous one answers; rounds
    alternate the two models.

Prints a table and a final JSON line, also written to bench/results/diffusion.json.
A benchmark, not a test: it asserts nothing; the ratios are against the baseline
measured in the same run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.server import ROOT, Server
from bitserve.diffusion.engine import DiffusionEngine
from bitserve.diffusion.evaluate import weights_path
from bitserve.diffusion.params import GenerationParams
from bitserve.diffusion.sampler import advance, denoise, new_row
from bitserve.diffusion.unet import load_denoiser

RESULTS = ROOT / "bench" / "results" / "diffusion.json"


# ------------------------------------------------------------------- (a) CFG cost


def interleaved(fns: dict, repeat: int) -> dict[str, list[float]]:
    """Seconds of each function, run in turn within every repetition: on a shared
    machine a burst of load then falls on all of them alike, and per-repetition ratios
    cancel it."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def ratio(times: dict, a: str, b: str) -> float:
    """The median over repetitions of a's time over b's."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


@torch.inference_mode()
def cfg_cost(model_dir: Path, rows: list[int], repeat: int) -> list[dict]:
    model, _ = load_denoiser(weights_path(model_dir))
    null = model.config.null_label
    out = []
    for r in rows:
        g = torch.Generator().manual_seed(r)
        x = torch.randn(r, 1, 16, 16, generator=g)
        t = torch.randint(0, 1000, (r,), generator=g)
        label = torch.randint(0, 10, (r,), generator=g)
        both = torch.ones(r, dtype=torch.bool)
        nulls = torch.full_like(label, null)
        times = interleaved(
            {
                "unguided": lambda: model(x, t, label),  # noqa: B023
                "two": lambda: (model(x, t, label), model(x, t, nulls)),  # noqa: B023
                "batched": lambda: model.guided(x, t, label, both),  # noqa: B023
            },
            repeat,
        )
        out.append(
            {
                "rows": r,
                "unguided_ms": statistics.median(times["unguided"]) * 1e3,
                "two_passes_ms": statistics.median(times["two"]) * 1e3,
                "batched_cfg_ms": statistics.median(times["batched"]) * 1e3,
                "cfg_vs_unguided": ratio(times, "batched", "unguided"),
                "cfg_vs_two_passes": ratio(times, "batched", "two"),
            }
        )
    return out


@torch.inference_mode()
def serial_overhead(model_dir: Path, steps: int, scale: float, repeat: int) -> dict:
    """Is the served one-at-a-time baseline a fair loop? One image's `steps` steps as a
    plain loop (the anchors' way: denoise, update, repeat; no queue, no lock) against
    the same image through the engine with max_rows = 1, the serving baseline (b)."""
    model, schedule = load_denoiser(weights_path(model_dir))
    params = GenerationParams(label=7, guidance_scale=scale, steps=steps, seed=1)
    abar = torch.cat([schedule.alphas_cumprod(), torch.ones(1, dtype=torch.float64)])
    engine = DiffusionEngine(model, schedule, max_rows=1)

    def plain() -> None:
        row = new_row(params, schedule, model.config.size, 1)
        while not row.done:
            eps, _ = denoise(model, [row])
            advance([row], eps, abar)

    def served() -> None:
        engine.submit(params)
        while engine.step():
            pass

    times = interleaved({"plain": plain, "engine": served}, repeat)
    return {
        "plain_loop_ms": statistics.median(times["plain"]) * 1e3,
        "engine_serial_ms": statistics.median(times["engine"]) * 1e3,
        "engine_vs_plain": ratio(times, "engine", "plain"),
    }


# ---------------------------------------------------------------- (b) serving


def repository(model_dir: Path, into: Path) -> Path:
    """models/digits twice: batched as committed, and serial (max_rows = 1)."""
    repo = into / "models"
    text = (model_dir / "config.toml").read_text()
    for name, config in (
        ("digits", text),
        ("digits_serial", text.replace("max_rows = 64", "max_rows = 1")),
    ):
        assert name == "digits" or config != text, "config.toml has no max_rows = 64 line"
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.toml").write_text(config)
        shutil.copy(weights_path(model_dir), repo / name / "1" / "model.safetensors")
    return repo


def infer_body(label: int, seed: int, steps: int, scale: float) -> bytes:
    def tensor(name, datatype, value):
        return {"name": name, "datatype": datatype, "shape": [1, 1], "data": [value]}

    inputs = [
        tensor("label", "INT32", label),
        tensor("seed", "INT64", seed),
        tensor("steps", "INT32", steps),
        tensor("guidance_scale", "FP32", scale),
    ]
    return json.dumps({"inputs": inputs}).encode()


def load(port: int, model: str, clients: int, requests: int, steps: int, scale: float) -> dict:
    """Closed loop: each client sends `requests` one after another; all start together.
    Returns the latencies and the wall time."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start.wait()
        for k in range(requests):
            body = infer_body((c + k) % 10, 1000 * c + k, steps, scale)
            sent = time.perf_counter()
            conn.request("POST", f"/v2/models/{model}/infer", body)
            answer = conn.getresponse()
            payload = answer.read()
            with lock:
                if answer.status == 200:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors.append(payload.decode()[:200])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return {"latencies": latencies, "errors": errors, "seconds": time.perf_counter() - began}


def summary(model: str, runs: list[dict]) -> dict:
    latencies = sorted(x for r in runs for x in r["latencies"])
    seconds = sum(r["seconds"] for r in runs)
    return {
        "model": model,
        "images": len(latencies),
        "errors": sum(len(r["errors"]) for r in runs),
        "seconds": seconds,
        "images_per_s": len(latencies) / seconds,
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def serving(args: argparse.Namespace) -> list[dict]:
    """Rounds alternate the two models, so that load from elsewhere on a shared
    machine falls on both alike."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(args.model, Path(tmp))
        server = Server.bitserve(repo, threads=args.threads).start()
        runs: dict[str, list[dict]] = {"digits_serial": [], "digits": []}
        try:
            for model in runs:
                load(server.port, model, 2, 1, 5, args.scale)  # warm the HTTP path
            for round_ in range(args.rounds):
                for model, done in runs.items():
                    done.append(
                        load(
                            server.port, model, args.clients, args.requests, args.steps, args.scale
                        )
                    )
                    rate = len(done[-1]["latencies"]) / done[-1]["seconds"]
                    print(f"  round {round_ + 1} {model}: {rate:.2f} images/s", flush=True)
            engines = {model: engine_metrics(server.port, model) for model in runs}
        finally:
            server.stop()
        return [{**summary(model, done), **engines[model]} for model, done in runs.items()]


def engine_metrics(port: int, model: str) -> dict:
    """The server's own view of its step loop, from /metrics (warm-up included)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    values = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("bitserve_diffusion_") and f'model="{model}"' in line:
            name = line.split("{", 1)[0]
            if name.endswith("_bucket"):
                continue
            values[name.removeprefix("bitserve_diffusion_")] = float(line.rsplit(" ", 1)[1])
    steps = values.get("steps_total", 0.0)
    return {
        "steps": steps,
        "steps_per_busy_s": values.get("steps_per_second", 0.0),
        "rows_per_step": values.get("rows_per_step_sum", 0.0) / max(steps, 1.0),
        "queue_mean_s": values.get("queue_seconds_sum", 0.0)
        / max(values.get("queue_seconds_count", 0.0), 1.0),
    }


# ------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "digits")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and served")
    parser.add_argument("--skip-serving", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("(a) one CFG step at R rows: batched halves vs two passes vs one unguided pass")
    cfg = cfg_cost(args.model, [int(r) for r in args.rows.split(",")], args.repeat)
    print(f"{'rows':>5} {'unguided ms':>12} {'two passes':>11} {'batched CFG':>12} "
          f"{'CFG/unguided':>13} {'CFG/two':>8}")  # fmt: skip
    for r in cfg:
        print(
            f"{r['rows']:>5} {r['unguided_ms']:>12.2f} {r['two_passes_ms']:>11.2f} "
            f"{r['batched_cfg_ms']:>12.2f} {r['cfg_vs_unguided']:>13.2f} "
            f"{r['cfg_vs_two_passes']:>8.2f}"
        )
    result: dict = {"threads": args.threads, "cfg": cfg}
    fair = serial_overhead(args.model, args.steps, args.scale, max(5, args.repeat // 4))
    result["serial_overhead"] = fair
    print(
        f"\none image alone, {args.steps} steps: plain loop {fair['plain_loop_ms']:.1f} ms, "
        f"through the engine (max_rows = 1, the baseline of (b)) {fair['engine_serial_ms']:.1f}"
        f" ms: {fair['engine_vs_plain']:.2f}x"
    )
    if not args.skip_serving:
        print(
            f"\n(b) {args.clients} clients x {args.requests} requests x {args.rounds} rounds, "
            f"{args.steps} steps, s = {args.scale}, over HTTP"
        )
        rows = serving(args)
        serial, batched = rows
        print(
            f"{'server':>14} {'images/s':>9} {'p50 s':>7} {'p99 s':>7} {'errors':>7} "
            f"{'steps/s':>8} {'rows/step':>10} {'queue s':>8}"
        )
        for r in rows:
            print(
                f"{r['model']:>14} {r['images_per_s']:>9.2f} {r['p50_s']:>7.2f} "
                f"{r['p99_s']:>7.2f} {r['errors']:>7} {r['steps_per_busy_s']:>8.1f} "
                f"{r['rows_per_step']:>10.2f} {r['queue_mean_s']:>8.3f}"
            )
        result["serving"] = rows
        result["throughput_ratio"] = batched["images_per_s"] / serial["images_per_s"]
        result["p99_ratio"] = batched["p99_s"] / serial["p99_s"]
        print(
            f"step-level batching: {result['throughput_ratio']:.2f}x the images/s, "
            f"p99 {result['p99_ratio']:.2f}x the one-at-a-time loop's"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
