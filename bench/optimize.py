"""Speeding up the detector: every `bitserve optimize` technique against the teacher,
in one run, then the variants served through v2.

    .venv/bin/python bench/optimize.py [--quick] [--report models/detector/report]

1. Copies models/detector (config and teacher.safetensors) into build/optimize-bench,
   exports the teacher as version 1, and runs `bitserve optimize`'s own `optimize()`:
   int8 (onnxruntime QDQ static), 50% channel pruning + fine-tune, a distilled student,
   resolution 96 and 64, eager torch against ONNX Runtime, and pruned/student crossed
   with int8 and 96 px. All timing is on one thread, variants interleaved round by
   round; ratios are against the teacher's ONNX graph measured in the same run.
2. Serves the copy (every version) with `bitserve serve` and checks each version
   answers with the same output shapes through tritonclient, then measures the
   teacher's served throughput at concurrency 1 and 16 (the dynamic batcher's gain).

Goals (issue 19): teacher mAP@.5 >= 0.9; int8 >= 2x batch-1 at <= 1 mAP point lost;
student >= 2x at <= 3 points; resolution 96 >= 1.5x; the best combination >= 4x at
<= 3 points; served c=16 throughput >= 2x c=1. Prints the table, the goals, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bitserve.optimize import report  # noqa: E402
from bitserve.optimize.run import OptimizeConfig, optimize  # noqa: E402
from bitserve.vision import data  # noqa: E402


def prepare(work: Path) -> Path:
    from build_models import build

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


def serve(repository: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "bitserve.cli", "serve", "--repository", str(repository)]
    log = (repository.parent / "server.log").open("w")
    process = subprocess.Popen(
        [*command, "--port", str(port), "--threads", "1"], stdout=log, stderr=log, env=env
    )
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code == 200:
                return process, f"127.0.0.1:{port}"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("server not ready; see server.log")


def served(repository: Path, versions: dict[str, int], seconds: float) -> dict:
    import tritonclient.http as triton

    process, url = serve(repository)
    try:
        client = triton.InferenceServerClient(url, concurrency=16)
        images = [c.image[None, ..., None] for c in data.heldout(64)]

        def send(image, version="1"):
            tensor = triton.InferInput("image", list(image.shape), "UINT8")
            tensor.set_data_from_numpy(image, binary_data=True)
            return client.async_infer("detector", [tensor], model_version=version)

        def shapes_of(result):
            return {n: result.as_numpy(n).shape for n in ("boxes", "scores", "classes")}

        everyone = {"teacher": 1, **versions}
        shapes = {
            name: shapes_of(send(images[0], str(v)).get_result()) for name, v in everyone.items()
        }
        same = len({json.dumps(s, sort_keys=True) for s in shapes.values()}) == 1
        rates = {}
        for concurrency in (1, 16):
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:  # waves of `concurrency` in flight
                wave = [send(images[(done + i) % 64]) for i in range(concurrency)]
                done += len([w.get_result() for w in wave])
            rates[concurrency] = done / (time.perf_counter() - start)
        client.close()
    finally:
        process.terminate()
        process.wait(10)
    return {"shapes": shapes, "same_shapes": same, "req_per_s": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short training, few rounds")
    parser.add_argument("--report", type=Path, default=ROOT / "bench/results/optimize")
    parser.add_argument("--work", type=Path, default=ROOT / "build/optimize-bench")
    parser.add_argument("--prune-steps", type=int, default=300)
    parser.add_argument("--distill-steps", type=int, default=600)
    args = parser.parse_args()
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
    serving = served(folder.parent, result["versions"], 3 if args.quick else 10)
    ratio = serving["req_per_s"][16] / serving["req_per_s"][1]
    checks.append(("every version serves with the same output shapes", serving["same_shapes"], ""))
    checks.append(
        (
            "served throughput c=16 >= 2x c=1",
            ratio >= 2,
            f"{serving['req_per_s'][1]:.0f} -> {serving['req_per_s'][16]:.0f} req/s, {ratio:.2f}x",
        )
    )
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
