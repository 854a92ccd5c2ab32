"""Cold start: how long from process start to ready, and where the time went.

Serverless and autoscaled deployments pay the cold start on every new replica, so
`bitserve serve` measures it and says where it goes: importing Python and the
libraries, loading weights (safetensors are memory-mapped), and warm-up requests. The
phases are wall-clock intervals that add up to the total exactly ("other" holds what is
not a load or a warm-up: scheduling, opening the port).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat, counted after the name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


Span = tuple[float, float]  # wall-clock (start, end), time.time() seconds


def spans(ended: float, load: float, warmup: float) -> tuple[Span, Span]:
    """The load and warm-up spans of something that loaded for `load` s, then warmed up
    for `warmup` s, and was done at wall-clock `ended`."""
    return (ended - warmup - load, ended - warmup), (ended - warmup, ended)


@dataclass
class Startup:
    total: float
    imports: float
    load: float
    warmup: float
    other: float

    def phases(self) -> dict[str, float]:
        return {
            "import": self.imports,
            "load": self.load,
            "warmup": self.warmup,
            "other": self.other,
            "total": self.total,
        }

    def describe(self) -> str:
        return (
            f"ready {self.total:.2f} s after process start: import {self.imports:.2f} s, "
            f"weight load {self.load:.2f} s, warmup {self.warmup:.2f} s, other {self.other:.2f} s"
        )


def breakdown(
    started: float,
    imported: float,
    ready: float,
    loads: list[Span],
    warmups: list[Span],
    preimport: float = 0.0,
) -> Startup:
    """Phases as wall-clock time, so they add up to the total even though models load
    and warm up in parallel: `load` is the time during which at least one model was
    loading weights, `warmup` the time at least one was warming up and none loading.
    `preimport` (the heavy libraries, imported once before loading) counts as import."""
    total = max(ready - started, 0.0)
    imports = min(max(imported - started, 0.0) + preimport, total)
    window = (started + imports, started + total)
    load_union, warmup_union = _union(_clip(loads, window)), _union(_clip(warmups, window))
    load = _length(load_union)
    warmup = _length(warmup_union) - _overlap(warmup_union, load_union)
    return Startup(total, imports, load, warmup, max(total - imports - load - warmup, 0.0))


def _clip(intervals: list[Span], window: Span) -> list[Span]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _union(intervals: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: list[Span]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[Span], ys: list[Span]) -> float:
    """Total length where two disjoint, sorted interval lists overlap."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)
