"""Load shapes: closed loop (fixed concurrency) and open loop (arrivals at a rate).

Closed loop: N users, each sending its next request when the previous one answers, so
the server's speed sets the request rate (perf_analyzer's `--concurrency-range`). Open
loop: requests arrive on a schedule that does not wait for answers (`vllm bench serve
--request-rate`): inter-arrival times are gamma-distributed with shape `burstiness`
and mean 1/rate, so burstiness 1 is a Poisson process, below 1 burstier, above 1
more regular. Both are bounded by a request count and/or a duration, and each request
by a timeout, so a run always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bitserve.loadtest.client import ConnectionLost, Pool, StaleConnection
from bitserve.loadtest.stream import Result, StreamReader, read_full
from bitserve.loadtest.workloads import Request


@dataclass
class Load:
    """One point of a sweep: the load shape and its bounds."""

    concurrency: int | None = None  # closed loop: this many users
    rate: float | None = None  # open loop: requests per second (inf: all at once)
    burstiness: float = 1.0  # gamma shape of inter-arrivals; 1 = Poisson
    max_concurrency: int | None = None  # open loop: cap on requests in flight
    num_requests: int | None = None
    duration: float | None = None  # seconds; no request is sent after it
    timeout: float = 60.0  # per request
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a load is closed (concurrency) or open (rate), not both")
        if self.num_requests is None and self.duration is None:
            raise ValueError("a load needs a bound: num_requests or duration")
        if self.rate is not None and math.isinf(self.rate) and self.num_requests is None:
            raise ValueError("an infinite rate needs num_requests")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be > 0")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.rate:g}"


@dataclass
class Run:
    """What one point produced: every request's record and the wall time they took."""

    load: Load
    results: list[Result]
    duration: float  # first send to last answer


def intervals(rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n inter-arrival gaps: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate."""
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(load: Load) -> np.ndarray:
    """Send offsets (seconds from start) of an open-loop point, within both bounds."""
    rng = np.random.default_rng(load.seed)
    if load.num_requests is not None:
        times = np.cumsum(intervals(load.rate, load.burstiness, load.num_requests, rng))
    else:
        chunks, total = [], 0.0
        while total <= load.duration:
            chunk = np.cumsum(intervals(load.rate, load.burstiness, 1024, rng)) + total
            chunks.append(chunk)
            total = chunk[-1]
        times = np.concatenate(chunks)
    if math.isinf(load.rate):
        times = times[: load.num_requests]
    elif load.duration is not None:
        times = times[times <= load.duration]
    return times - times[0] if len(times) else times


async def send(pool: Pool, request: Request, timeout: float) -> Result:
    """One request on an idle connection; any failure becomes an error kind, not a raise."""
    result = Result(start=time.perf_counter(), prompt_len=request.prompt_len)
    reader = StreamReader(result.start) if request.stream else None
    conn = None
    try:
        conn = await pool.get()
        result.start = time.perf_counter()  # connecting is not the server's latency
        if reader is not None:
            reader.start = result.start
        try:
            status, body = await conn.request(request.raw, reader.feed if reader else None, timeout)
        except StaleConnection:  # never reached the server: once more on a new connection
            pool.put(conn)
            conn = await pool.fresh()
            status, body = await conn.request(request.raw, reader.feed if reader else None, timeout)
        result.latency = time.perf_counter() - result.start
    except TimeoutError:
        result.error, result.latency = "timeout", time.perf_counter() - result.start
        return result
    except (ConnectionLost, OSError):
        result.error, result.latency = "connection", time.perf_counter() - result.start
        return result
    finally:
        if conn is not None:
            pool.put(conn)
    if status >= 400:
        result.error = f"http_{status}"
    elif reader is not None:
        reader.finish(result)
    else:
        read_full(result, body)
    return result


async def closed_loop(pool: Pool, requests: list[Request], load: Load, record: Callable) -> None:
    """`concurrency` users; each takes the next request until a bound is reached.

    The users share one cursor into `requests`, so no request is sent twice before all
    have been sent once, whatever order the answers come back in: a repeated prompt
    would hit a server's prefix cache as often as its completion order makes it."""
    end = time.perf_counter() + load.duration if load.duration else math.inf
    limit = load.num_requests if load.num_requests is not None else math.inf
    taken = 0

    async def user() -> None:
        nonlocal taken
        while taken < limit and time.perf_counter() < end:
            request = requests[taken % len(requests)]
            taken += 1
            record(await send(pool, request, load.timeout))

    await asyncio.gather(*(user() for _ in range(load.concurrency)))


async def open_loop(pool: Pool, requests: list[Request], load: Load, record: Callable) -> None:
    """Each request is sent at its arrival time, whatever is still in flight."""
    times = arrival_times(load)
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start, loop = time.perf_counter(), asyncio.get_running_loop()

    async def one(i: int) -> None:
        async with cap or contextlib.nullcontext():
            record(await send(pool, requests[i % len(requests)], load.timeout))

    tasks = []
    for i, at in enumerate(times):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(i)))
    await asyncio.gather(*tasks)


def run(url: str, requests: list[Request], load: Load, on_result: Callable | None = None) -> Run:
    """Run one point on a fresh event loop (uvloop when present); the collector is off
    while requests are timed, so no GC pause lands inside a measured request."""
    results: list[Result] = []

    def record(result: Result) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    async def main() -> float:
        pool, t0 = Pool(url), time.perf_counter()
        try:
            shape = closed_loop if load.concurrency else open_loop
            await shape(pool, requests, load, record)
        finally:
            pool.close()
        return max((r.start + r.latency for r in results), default=t0) - t0

    gc.collect()
    gc.disable()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            duration = runner.run(main())
    finally:
        gc.enable()
    return Run(load, results, duration)


def _loop_factory():
    try:
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return asyncio.new_event_loop
