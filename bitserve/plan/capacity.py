"""Capacity planning: replay an arrival process through the real dynamic batcher.

Queueing formulas assume one request per service; a batcher serves a variable batch
whose time depends on its size and whose departure rules (max size, preferred sizes,
the oldest request's delay, dispatch when idle) shape the wait. So the simulation
drives bitserve's own `DynamicBatcher` on a `ManualClock`: arrivals and batch
completions are timers, and each batch runs for the measured profile's time at its
size. Replicas sit behind a load balancer that picks one at random, so each sees the
stream thinned to 1/n; all are alike, so one is simulated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bitserve.batching.batcher import DynamicBatcher, Request
from bitserve.batching.clock import ManualClock
from bitserve.config import DynamicBatching
from bitserve.plan import accesslog
from bitserve.plan.fit import FAMILIES


@dataclass
class Profile:
    """Batch compute time = base + per_row x rows (ms), plus the per-request time spent
    outside the batcher (HTTP, parsing, encoding) that the client sees."""

    base_ms: float
    per_row_ms: float
    overhead_ms: float = 0.0

    def seconds(self, rows: int) -> float:
        return (self.base_ms + self.per_row_ms * rows) / 1e3


@dataclass
class Batching:
    max_batch_size: int = 1
    policy: DynamicBatching | None = None
    instances: int = 1


def line_fit(sizes: list[float], times_ms: list[float]) -> tuple[float, float]:
    """Least-squares (base, per_row); one size alone gives a flat profile."""
    if len(set(sizes)) < 2:
        return float(np.mean(times_ms)), 0.0
    per_row, base = np.polyfit(sizes, times_ms, 1)
    return float(max(base, 0.0)), float(max(per_row, 0.0))


def profile_from_bench(result: dict) -> Profile:
    """Each point of a `bitserve bench` run against bitserve has the server's mean batch
    size and compute time; the overhead is client E2E minus server queue + compute."""
    points = [p for p in result["points"] if (p.get("server") or {}).get("mean_compute_ms")]
    if not points:
        raise ValueError("the bench result has no server-side batch data (not a bitserve target?)")
    base, per_row = line_fit(
        [p["server"]["mean_batch_size"] for p in points],
        [p["server"]["mean_compute_ms"] for p in points],
    )
    light = min(points, key=lambda p: p["server"]["mean_batch_size"])
    inside = light["server"]["mean_queue_ms"] + light["server"]["mean_compute_ms"]
    return Profile(base, per_row, max(0.0, light["e2el"]["mean_ms"] - inside))


def profile_from_log(records: list[dict]) -> Profile:
    sizes = accesslog.batch_profile(records)
    base, per_row = line_fit(list(sizes), list(sizes.values()))
    ok = [r for r in records if r.get("status") == 200 and r.get("compute_ms") is not None]
    outside = [r["duration_ms"] - r["queue_ms"] - r["compute_ms"] for r in ok]
    return Profile(base, per_row, max(0.0, float(np.median(outside))) if outside else 0.0)


def load_profile(path: Path) -> Profile:
    """A bench result.json, or an access log (JSON lines)."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and "points" in whole:
        return profile_from_bench(whole)
    return profile_from_log(accesslog.read(path))


class Arrivals:
    """A renewal process: i.i.d. gaps from a fitted family, rescaled to a target rate."""

    def __init__(
        self, family: str = "exponential", params: dict | None = None, rate: float | None = None
    ):
        dist, names = FAMILIES[family]
        params = params or {"scale": 1.0}
        self.dist = dist(*[params[n] for n in names if n != "scale"], scale=params["scale"])
        self.family = family
        self.stretch = 1.0 if rate is None else self.dist.mean() * rate

    @property
    def rate(self) -> float:
        return self.stretch / self.dist.mean()

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        gaps = self.dist.rvs(size=n, random_state=rng) / self.stretch
        return np.cumsum(gaps)


def simulate(arrival_times: np.ndarray, profile: Profile, batching: Batching) -> np.ndarray:
    """Latency (seconds) of each request through one replica's batcher, in arrival order."""
    clock = ManualClock()
    done = np.full(len(arrival_times), np.nan)
    batcher: DynamicBatcher

    def execute(slot: int, batch: list[Request]) -> None:
        end = clock.now() + profile.seconds(sum(r.rows for r in batch))

        def finish() -> None:
            for r in batch:
                done[r.inputs] = clock.now() - r.arrival
            batcher.release(slot)

        clock.call_at(end, finish)

    batcher = DynamicBatcher(
        "sim", batching.max_batch_size, batching.policy, batching.instances, execute, clock
    )
    for i, at in enumerate(arrival_times):
        clock.advance_to(at)
        batcher.submit(Request(i, 1, at))
    clock.advance_to(float("inf"))
    return done + profile.overhead_ms / 1e3


def p99_ms(
    arrivals: Arrivals,
    profile: Profile,
    batching: Batching,
    replicas: int = 1,
    requests: int = 20000,
    seed: int = 0,
) -> float:
    """p99 latency at one replica when the stream is split over `replicas` at random;
    the first 5% of requests (the queue filling from empty) are left out."""
    rng = np.random.default_rng(seed)
    times = arrivals.times(requests * replicas, rng)
    mine = times[rng.integers(0, replicas, size=len(times)) == 0]
    latencies = simulate(mine - mine[0], profile, batching)[len(mine) // 20 :]
    return float(np.percentile(latencies, 99) * 1e3)


def replicas_needed(arrivals, profile, batching, slo_ms: float, limit: int = 64, **kw):
    """The fewest replicas whose simulated p99 is within the SLO: [(n, p99)] tried, and
    n or None. p99 falls as replicas grow, so the search stops at the first success."""
    tried = []
    for n in range(1, limit + 1):
        tried.append((n, p99_ms(arrivals, profile, batching, n, **kw)))
        if tried[-1][1] <= slo_ms:
            return tried, n
    return tried, None
