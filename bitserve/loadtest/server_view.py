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
# speculative decoding's counters (llm/speculative.py): proposed and accepted, by position
_SPEC = re.compile(
    r"^bitserve_llm_spec_decode_num_(draft|accepted)_tokens(_per_pos)?_total\{([^}]*)\}\s+(\S+)"
)
_POSITION = re.compile(r'position="(\d+)"')


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
        spec = _SPEC.match(line)
        if spec and f'model="{model}"' in spec.group(3):
            position = _POSITION.search(spec.group(3)) if spec.group(2) else None
            key = f"spec_{spec.group(1)}" + (f"_{position.group(1)}" if position else "")
            totals[key] = totals.get(key, 0.0) + float(spec.group(4))
            continue
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

    view = {
        "requests": int(delta("queue_count")),
        "batches": int(delta("batch_count")),
        "mean_queue_ms": mean("queue", 1e3),
        "mean_compute_ms": mean("compute", 1e3),
        "mean_batch_size": mean("batch"),
    }
    if delta("spec_draft") > 0:  # speculative decoding: acceptance, overall and by position
        view["spec_acceptance"] = delta("spec_accepted") / delta("spec_draft")
        rates, position = [], 0
        while delta(f"spec_draft_{position}") > 0:
            rates.append(delta(f"spec_accepted_{position}") / delta(f"spec_draft_{position}"))
            position += 1
        view["spec_acceptance_by_position"] = "/".join(f"{r:.2f}" for r in rates)
    return view
