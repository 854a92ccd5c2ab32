"""Calibrate the roofline with a `bitserve bench` result measured on this machine.

A roofline is an upper bound; the engine reaches some fraction of it. An OpenAI-API
bench run at low load measures that fraction directly: its median TPOT against the
predicted decode step gives the bandwidth efficiency, its median TTFT against the
predicted prefill the FLOP/s efficiency. Both are then applied to the other CPU shapes,
whose figures come from datasheets, on top of the default discount.
"""

from __future__ import annotations

import json
from pathlib import Path

from bitserve.plan import hardware
from bitserve.plan.catalogue import Shape
from bitserve.plan.shape import ModelShape


def lightest_point(result: dict) -> dict | None:
    """The point with the lowest request rate that measured TPOT and TTFT: the one where
    queueing and batching distort the per-token times least."""
    points = [
        p for p in result.get("points", [])
        if p.get("completed") and (p.get("tpot") or {}).get("median_ms")
        and (p.get("ttft") or {}).get("median_ms")
    ]  # fmt: skip
    return min(points, key=lambda p: p["request_throughput"], default=None)


def calibrate(path: Path, model: ModelShape, here: Shape) -> tuple[hardware.Efficiency, str]:
    """(efficiency relative to `here`'s figures, a sentence saying where it came from)."""
    result = json.loads(path.read_text())
    point = lightest_point(result)
    if point is None:
        raise ValueError(f"{path}: no point with TTFT and TPOT (run bench with --api completions)")
    n = point["completed"]
    input_len = max(1, round(point["total_input_tokens"] / n))
    output_len = max(1, round(point["total_output_tokens"] / n))
    ideal = hardware.Efficiency(1.0, 1.0)
    weights = hardware.memory.weight_bytes(model, here.dtype, None)
    step = hardware.step_time(model, here, ideal, 1, input_len + output_len // 2, weights)
    prefill = hardware.prefill_time(model, here, ideal, input_len, weights)
    tpot, ttft = point["tpot"]["median_ms"] / 1e3, point["ttft"]["median_ms"] / 1e3
    eff = hardware.Efficiency(bandwidth=min(1.0, step / tpot), flops=min(1.0, prefill / ttft))
    note = (
        f"calibrated on {here.name} by {path} ({point['load']}): "
        f"TPOT {tpot * 1e3:.2f} ms vs "
        f"roofline {step * 1e3:.2f} ms -> bandwidth efficiency {eff.bandwidth:.2f}; TTFT "
        f"{ttft * 1e3:.1f} ms vs prefill {prefill * 1e3:.1f} ms "
        f"-> FLOP/s efficiency {eff.flops:.2f}"
    )
    return eff, note
