"""The server's own view of a run: bitserve's `/metrics` scraped before and after.

The client sees latency; only the server knows how much of it was waiting in the batch
queue and how much was compute, and how big the batches it formed were. The difference
of each histogram's `_sum` and `_count` between two scrapes gives the mean over exactly
the requests of the run. Targets that are not bitserve have no such metrics: None.
"""

from __future__ import annotations

import re
import urllib.request

HISTOGRAMS = {
    "queue": "bitserve_queue_duration_seconds",
    "compute": "bitserve_compute_duration_seconds",
    "batch": "bitserve_batch_size",
}
_SAMPLE = re.compile(r"^(\w+?)_(sum|count)\{([^}]*)\}\s+(\S+)")


def scrape(url: str, model: str, timeout: float = 5.0) -> dict[str, float] | None:
    """{'queue_sum': s, 'queue_count': n, ...} for `model` (all versions), or None."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    wanted = {metric: key for key, metric in HISTOGRAMS.items()}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in wanted or f'model="{model}"' not in match.group(3):
            continue
        key = f"{wanted[match.group(1)]}_{match.group(2)}"
        totals[key] = totals.get(key, 0.0) + float(match.group(4))
    return totals or None


def difference(before: dict | None, after: dict | None) -> dict | None:
    """Mean queue and compute time (ms) and mean batch size over the run."""
    if before is None or after is None:
        return None

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def mean(name: str, scale: float = 1.0) -> float | None:
        count = delta(f"{name}_count")
        return delta(f"{name}_sum") / count * scale if count else None

    return {
        "requests": int(delta("queue_count")),
        "batches": int(delta("batch_count")),
        "mean_queue_ms": mean("queue", 1e3),
        "mean_compute_ms": mean("compute", 1e3),
        "mean_batch_size": mean("batch"),
    }
