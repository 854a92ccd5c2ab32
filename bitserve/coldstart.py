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


def breakdown(started: float, imported: float, ready: float, load: float, warmup: float) -> Startup:
    """Phases from wall-clock marks; load and warmup are summed over models, which load
    one at a time (see backends.base.LOAD_LOCK), so they fit inside the loading window."""
    total = ready - started
    imports = max(imported - started, 0.0)
    window = max(total - imports, 0.0)
    scale = min(1.0, window / (load + warmup)) if load + warmup > 0 else 1.0
    load, warmup = load * scale, warmup * scale
    return Startup(total, imports, load, warmup, total - imports - load - warmup)
