"""One infer request's bookkeeping, the same on every protocol (v2 HTTP, v2 gRPC).

`recorded(state, version, route)` wraps the request: the in-flight gauge, the duration
histogram, the success and failure counters (the failure's reason from errors.py), the
access log line `bitserve plan fit` reads, and the rollout statistics of its route. The
front-end fills in what it learns (`parsed`, `job`, `outputs`); the status comes from
how the block ends: 200, 499 (the client left) or the error's mapped status.

A front-end that answers from a callback instead of a block (gRPC's streams) calls
`record.close(error)` itself, once, with None on success; the block calls it on exit.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TextIO

import orjson

from bitserve.repository.version import ModelVersion
from bitserve.server.errors import reason_of, status_of
from bitserve.server.state import ServerState


class Record:
    """The request's bookkeeping from its creation (in flight, the clock running) to
    `close`. A plain class rather than a generator context manager: it runs on every
    request of every protocol."""

    __slots__ = ("job", "outputs", "parsed", "route", "started", "state", "status", "version")

    def __init__(self, state: ServerState, version: ModelVersion, route: Any):
        self.state, self.version, self.route = state, version, route
        self.status = 500
        self.parsed: Any = None  # the InferRequest, once parsed
        self.job: Any = None  # the batcher's request (queue and compute times), when batched
        self.outputs: Any = None
        version.m["inflight"].inc()
        self.started = time.perf_counter()

    def __enter__(self) -> Record:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    def close(self, exc: BaseException | None) -> None:
        """Count the request: a success when `exc` is None, else a failure (499 for a
        client that left)."""
        version, state = self.version, self.state
        m = version.m
        if exc is None:
            self.status = 200
        elif isinstance(exc, asyncio.CancelledError):  # the client left (or its deadline passed)
            self.status = 499
        elif isinstance(exc, Exception):
            self.status = status_of(exc)
            state.metrics.failure.labels(*_labels(version), reason_of(exc)).inc()
        m["inflight"].dec()
        seconds = time.perf_counter() - self.started
        m["duration"].observe(seconds)
        if state.options.access_log is not None:
            access_log(state.options.access_log, _labels(version), self.status, seconds, self.job)
        if self.route is not None:
            self.route.finish(self.status, seconds, self.parsed, self.outputs)
        if exc is None:
            m["success"].inc()


def recorded(state: ServerState, version: ModelVersion, route: Any) -> Record:
    """`with recorded(...) as record:` the request's block."""
    return Record(state, version, route)


def _labels(version: ModelVersion) -> tuple[str, str]:
    return version.config.name, str(version.version)


def access_log(out: TextIO, labels: tuple, status: int, seconds: float, job: Any) -> None:
    """One JSON line per infer request, for `bitserve plan fit` and friends."""
    line = {
        "time": time.time(),
        "model": labels[0],
        "version": labels[1],
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "queue_ms": round(job.queue_seconds * 1000, 3) if job else None,
        "compute_ms": round(job.compute_seconds * 1000, 3) if job else None,
        "batch_size": job.batch_rows if job else None,
        "rows": job.rows if job else None,
    }
    out.write(orjson.dumps(line).decode() + "\n")
    out.flush()
