"""bitserve's JSON access log (`bitserve serve --access-log FILE`), read for planning.

Each line is written when a request finishes: `time` is the end, so a request arrived
at time - duration_ms. Inter-arrival times are the gaps between sorted arrivals; only
successful requests are used for latencies (errors have their own, shorter, times).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read(path: Path, model: str | None = None) -> list[dict]:
    """The log's records, of one model if asked; malformed lines are skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        usable = isinstance(record, dict) and "time" in record and "duration_ms" in record
        if usable and (model is None or record.get("model") == model):
            records.append(record)
    if not records:
        raise ValueError(
            f"{path}: no access log records" + (f" for model {model!r}" if model else "")
        )
    return records


def arrivals(records: list[dict]) -> np.ndarray:
    """Arrival instants (seconds, sorted) of every request, failed ones included."""
    return np.sort([r["time"] - r["duration_ms"] / 1e3 for r in records])


def inter_arrivals(records: list[dict]) -> np.ndarray:
    return np.diff(arrivals(records))


def latencies_ms(records: list[dict]) -> np.ndarray:
    return np.array([r["duration_ms"] for r in records if r.get("status") == 200], dtype=float)


def batch_profile(records: list[dict]) -> dict[int, float]:
    """Median compute time (ms) per batch size seen: the model's batch latency profile."""
    by_size: dict[int, list[float]] = {}
    for r in records:
        if r.get("status") == 200 and r.get("batch_size") and r.get("compute_ms") is not None:
            by_size.setdefault(int(r["batch_size"]), []).append(float(r["compute_ms"]))
    return {size: float(np.median(times)) for size, times in sorted(by_size.items())}
