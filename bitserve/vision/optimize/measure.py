"""What a variant costs and buys: accuracy, latency, throughput, size.

Every session runs on one intra-op thread, so a run executes on the calling thread
and its cost is that thread's CPU time (`time.thread_time`). Latency p50/p95 are CPU
time: on a shared machine (this one: 2 cores, several engineers' jobs, load 5-7) wall
time mostly measures how often the scheduler preempts a run, and it punishes a long
run more than a short one. Wall-clock p50 is reported beside it. All variants are
timed in one interleaved loop (each round runs every variant once), so a drift slows
all of them alike and the ratios against the baseline stay fair.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bitserve.vision import data, evaluate

Run = Callable[[np.ndarray], tuple]


@dataclass
class Variant:
    name: str
    techniques: list[str]
    run: Run  # uint8 [N, H, W] -> boxes, scores, classes
    resolution: int
    size_bytes: int
    train_minutes: float = 0.0
    onnx: str | None = None  # the exported graph's path (None: eager torch)
    metrics: dict = field(default_factory=dict)


def ort_run(path, threads: int = 1) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return evaluate.session_detect(session)


def torch_run(deployed) -> Run:
    import torch

    def run(images: np.ndarray) -> tuple:
        with torch.inference_mode():
            return tuple(t.numpy() for t in deployed(torch.from_numpy(images[..., None])))

    return run


def accuracy(variants: list[Variant], canvases: list[data.Canvas]) -> None:
    for v in variants:
        v.metrics.update(evaluate.mean_ap(v.run, canvases))


def speed(variants: list[Variant], images: np.ndarray | dict, rounds: int, batch: int = 8) -> None:
    """Batch-1 p50/p95 latency (CPU ms), wall p50, batch-`batch` throughput (images
    per CPU-second of one core). `images`: one array for all, or one per variant name
    (graphs whose inputs differ, as at another resolution)."""
    feeds = images if isinstance(images, dict) else {v.name: images for v in variants}
    for v in variants:  # warm up: first runs allocate and pick kernels
        for _ in range(3):
            v.run(feeds[v.name][:1])
            v.run(feeds[v.name][:batch])
    single = {v.name: [] for v in variants}
    wall = {v.name: [] for v in variants}
    batched = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            x = feeds[v.name]
            cpu, seconds = _times(v.run, x[r % len(x)][None])
            single[v.name].append(cpu)
            wall[v.name].append(seconds)
        if r % 4 == 0:
            for v in variants:
                x = feeds[v.name]
                batched[v.name].append(_times(v.run, np.roll(x, r, axis=0)[:batch])[0])
    for v in variants:
        ms = np.array(single[v.name]) * 1000
        v.metrics.update(
            p50_ms=float(np.percentile(ms, 50)),
            p95_ms=float(np.percentile(ms, 95)),
            wall_p50_ms=float(np.median(wall[v.name]) * 1000),
            throughput_b8=float(batch / np.median(batched[v.name])),
        )


def batch_curve(run: Run, images: np.ndarray, sizes=(1, 2, 4, 8, 16), rounds: int = 20) -> dict:
    """Images per CPU-second at each batch size (median of `rounds`)."""
    curve = {}
    for size in sizes:
        chunk = np.resize(images, (size, *images.shape[1:]))
        run(chunk)
        curve[size] = float(size / np.median([_times(run, chunk)[0] for _ in range(rounds)]))
    return curve


def _times(run: Run, images: np.ndarray) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) of one run."""
    cpu, wall = time.thread_time(), time.perf_counter()
    run(images)
    return time.thread_time() - cpu, time.perf_counter() - wall
