"""Client-side metrics with `vllm bench serve`'s definitions, so numbers compare.

- request throughput = completed requests / benchmark duration (first send to last answer);
  input/output token throughput likewise with the token sums of completed requests;
- TTFT: send to first token; TPOT: (E2E - TTFT) / (output tokens - 1), the first token
  excluded, for requests with more than one token; ITL: every gap between tokens;
  E2E: send to last byte. Each as mean, median, std, p90, p99 (numpy's linear percentile);
- goodput (DistServe): completed requests meeting every given SLO, per second;
- errors counted by kind.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from bitserve.loadtest.loadgen import Run
from bitserve.loadtest.stream import Result

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (ms in, seconds out)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"goodput SLO {item!r}: use NAME:MS with NAME in {SLO_METRICS}")
        slos[name] = float(value) / 1e3
    return slos


def tpot(result: Result) -> float | None:
    """Time per output token after the first; None for single-token answers."""
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def distribution(samples_s: list[float]) -> dict[str, float | None]:
    """mean, median, std and PERCENTILES of samples given in seconds, reported in ms."""
    if not samples_s:
        return {"mean_ms": None, "median_ms": None, "std_ms": None} | {
            f"p{p}_ms": None for p in PERCENTILES
        }
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    out = {
        "mean_ms": float(ms.mean()),
        "median_ms": float(np.median(ms)),
        "std_ms": float(ms.std()),
    }
    for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True):
        out[f"p{p}_ms"] = float(v)
    return out


def good(result: Result, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(values[name] <= limit for name, limit in slos.items())


def summarise(run: Run, slos: dict[str, float] | None = None) -> dict:
    """The point's summary: counts, throughputs, latency distributions, goodput, errors."""
    done = [r for r in run.results if r.ok]
    seconds = max(run.duration, 1e-9)
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_len for r in done)
    summary = {
        "load": run.load.label,
        "completed": len(done),
        "failed": len(run.results) - len(done),
        "errors": dict(Counter(r.error for r in run.results if not r.ok)),
        "duration_s": run.duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / seconds,
        "input_throughput": total_in / seconds,
        "output_throughput": total_out / seconds,
        "total_token_throughput": (total_in + total_out) / seconds,
        "ttft": distribution([r.ttft for r in done]),
        "tpot": distribution([t for r in done if (t := tpot(r)) is not None]),
        "itl": distribution([gap for r in done for gap in r.itl]),
        "e2el": distribution([r.latency for r in done]),
    }
    if slos:
        met = sum(good(r, slos) for r in done)
        summary["goodput"] = {"slos_ms": {k: v * 1e3 for k, v in slos.items()}, "requests": met}
        summary["request_goodput"] = met / seconds
    return summary


def samples(run: Run) -> dict[str, list[float]]:
    """Per-request TTFT and E2E (ms, completed requests) kept in the JSON for plots."""
    done = [r for r in run.results if r.ok]
    return {
        "ttft_ms": [round(r.ttft * 1e3, 4) for r in done],
        "e2el_ms": [round(r.latency * 1e3, 4) for r in done],
    }
