"""Speeding up the detector: every `bitserve optimize` technique against the teacher,
in one run, then the variants served through v2.

    .venv/bin/python -m bench.optimize [--quick] [--report models/detector/report]
    .venv/bin/python -m bench.optimize --served-only --report models/detector/report

1. Copies models/detector (config and teacher.safetensors) into build/optimize-bench,
   exports the teacher as version 1, and runs `bitserve optimize`'s own `optimize()`:
   int8 (onnxruntime QDQ static), 50% channel pruning + fine-tune, a distilled student,
   resolution 96 and 64, eager torch against ONNX Runtime, and pruned/student crossed
   with int8 and 96 px. All timing is on one thread, variants interleaved round by
   round; ratios are against the teacher's ONNX graph measured in the same run.
2. Serves the copy (every version) with `bitserve serve` and checks each version
   answers with the same output shapes through tritonclient, then measures served
   throughput at concurrency 1 and 16 for the teacher and the best variant (the
   dynamic batcher's gain; the config gives the detector two onnxruntime threads,
   which a batch can use and a single image mostly cannot).

Goals (issue 19): teacher mAP@.5 >= 0.9; int8 >= 2x batch-1 at <= 1 mAP point lost;
student >= 2x at <= 3 points; resolution 96 >= 1.5x; the best combination >= 4x at
<= 3 points; served c=16 throughput >= 2x c=1. Prints the table, the goals, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from bench.server import ROOT, Server
from bitserve.bench import loadgen
from bitserve.bench.workloads import Request
from bitserve.optimize import report
from bitserve.optimize.run import OptimizeConfig, optimize
from bitserve.vision import data


def prepare(work: Path) -> Path:
    from tools.build_models import build

    if work.exists():
        shutil.rmtree(work)
    folder = work / "models" / "detector"
    folder.mkdir(parents=True)
    for name in ("config.toml", "teacher.safetensors"):
        shutil.copyfile(ROOT / "models" / "detector" / name, folder / name)
    build(work / "models", names=["detector"])
    config = folder / "config.toml"
    config.write_text(config.read_text() + "\n[version_policy]\nall = true\n")
    return folder


def goals(result: dict) -> list[tuple[str, bool, str]]:
    rows = {r["name"]: r for r in result["variants"]}
    teacher, best = rows["teacher"], rows[result["best"]]

    def line(name, speed, points):
        r = rows[name]
        ok = r["speedup"] >= speed and r["delta_points"] >= -points
        return (
            f"{name}: >= {speed}x at <= {points} pts",
            ok,
            f"{r['speedup']:.2f}x, {r['delta_points']:+.1f} pts",
        )

    out = [
        ("teacher mAP@.5 >= 0.9", teacher["map50"] >= 0.9, f"{teacher['map50']:.3f}"),
        line("int8", 2.0, 1.0),
        line("student", 2.0, 3.0),
    ]
    r96 = rows["res96"]
    out.append(("res96: >= 1.5x", r96["speedup"] >= 1.5, f"{r96['speedup']:.2f}x"))
    out.append(
        (
            f"best combination ({best['name']}): >= 4x at <= 3 pts",
            best["speedup"] >= 4 and best["delta_points"] >= -3,
            f"{best['speedup']:.2f}x, {best['delta_points']:+.1f} pts",
        )
    )
    return out


def served(repository: Path, versions: dict[str, int], best: str, seconds: float) -> dict:
    """Every version's output shapes through tritonclient; then req/s at concurrency 1
    and 16 for the teacher and the best variant, from the repo's load generator
    (bitserve.bench.loadgen on its raw asyncio client: it costs far less per request
    than tritonclient, which would otherwise be the bottleneck), c=1 and c=16
    alternating twice."""
    import httpx
    import tritonclient.http as triton

    server = Server.bitserve(repository).start()
    url = server.url.removeprefix("http://")
    images = [c.image[None, ..., None] for c in data.heldout(64)]
    try:
        client = triton.InferenceServerClient(url)
        shapes = {}
        for name, number in {"teacher": 1, **versions}.items():
            tensor = triton.InferInput("image", [1, 128, 128, 1], "UINT8")
            tensor.set_data_from_numpy(images[0], binary_data=True)
            result = client.infer("detector", [tensor], model_version=str(number))
            shapes[name] = {n: result.as_numpy(n).shape for n in ("boxes", "scores", "classes")}
        client.close()
        same = len({json.dumps(s, sort_keys=True) for s in shapes.values()}) == 1
        rates = {}
        for name in dict.fromkeys(["teacher", best]):
            number = 1 if name == "teacher" else versions[name]
            runs = {1: [], 16: []}
            for concurrency in (1, 16, 1, 16):
                rate = _rate(server.url, number, images, concurrency, seconds / 2)
                runs[concurrency].append(rate)
            rates[name] = {c: float(np.mean(r)) for c, r in runs.items()}
        stats = httpx.get(f"{server.url}/v2/models/detector/stats").json()["model_stats"]
    finally:
        server.stop()
    batches = {s["version"]: s["batch_stats"] for s in stats if s["inference_count"]}
    return {"shapes": shapes, "same_shapes": same, "req_per_s": rates, "batch_stats": batches}


def _rate(url: str, version: int, images, concurrency: int, seconds: float) -> float:
    """Closed loop (bitserve.bench.loadgen): `concurrency` keep-alive connections, each
    sending its next request as soon as its answer arrives; requests/s over `seconds`."""
    requests = [Request(_raw_request(image, version)) for image in images]
    run = loadgen.run(url, requests, loadgen.Load(concurrency=concurrency, duration=seconds))
    errors = [r.error for r in run.results if r.error]
    assert not errors, errors
    return len(run.results) / run.duration


def _raw_request(image: np.ndarray, version: int) -> bytes:
    """A v2 infer request with the image as binary data, as HTTP/1.1 bytes."""
    tensor = {"name": "image", "datatype": "UINT8", "shape": list(image.shape)}
    tensor["parameters"] = {"binary_data_size": image.size}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    body = header + image.tobytes()
    head = (
        f"POST /v2/models/detector/versions/{version}/infer HTTP/1.1\r\nHost: bench\r\n"
        f"Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def serving_checks(serving: dict) -> list[tuple[str, bool, str]]:
    print(f"served batch sizes (size: count) per version: {serving['batch_stats']}")
    checks = [("every version serves with the same output shapes", serving["same_shapes"], "")]
    for name, rates in serving["req_per_s"].items():
        ratio = rates[16] / rates[1]
        figure = f"{rates[1]:.0f} -> {rates[16]:.0f} req/s, {ratio:.2f}x"
        checks.append((f"served {name}: throughput c=16 >= 2x c=1", ratio >= 2, figure))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short training, few rounds")
    parser.add_argument("--report", type=Path, default=ROOT / "bench/results/optimize")
    parser.add_argument("--work", type=Path, default=ROOT / "build/optimize-bench")
    parser.add_argument("--prune-steps", type=int, default=600)
    parser.add_argument("--distill-steps", type=int, default=2000)
    parser.add_argument(
        "--served-only",
        action="store_true",
        help="only the serving checks, on the versions and report of the last full run",
    )
    args = parser.parse_args()
    if args.served_only:
        last = json.loads((args.report / "report.json").read_text())
        folder = args.work / "models" / "detector"
        serving = served(folder.parent, last["versions"], last["best"], 12)
        for goal, ok, figure in serving_checks(serving):
            print(f"[{'PASS' if ok else 'FAIL'}] {goal}  {figure}")
        print(json.dumps({"bench": "optimize-served", "served_req_per_s": serving["req_per_s"]}))
        return
    import torch

    torch.set_num_threads(1)
    folder = prepare(args.work)
    quick = dict(prune_steps=5, distill_steps=5, heldout=50, rounds=20) if args.quick else {}
    config = OptimizeConfig(
        folder,
        report_dir=args.report,
        **({"prune_steps": args.prune_steps, "distill_steps": args.distill_steps} | quick),
    )
    result = optimize(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.markdown(result["variants"]))
    print(f"\nbest combination: {result['best']}  (batching: {result['batching']})")
    checks = goals(result)
    serving = served(folder.parent, result["versions"], result["best"], 4 if args.quick else 12)
    checks += serving_checks(serving)
    print()
    for goal, ok, figure in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {goal}  {figure}")
    summary = {
        "bench": "optimize",
        "best": result["best"],
        "variants": {
            r["name"]: {k: r[k] for k in ("map", "map50", "p50_ms", "speedup", "delta_points")}
            for r in result["variants"]
        },
        "served_req_per_s": serving["req_per_s"],
        "goals": {goal: ok for goal, ok, _ in checks},
        "report": result["files"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
