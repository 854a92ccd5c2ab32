"""One infer request's bookkeeping, the same on every protocol (v2 HTTP, v2 gRPC).

`recorded(state, version, route)` wraps the request: the in-flight gauge, the duration
histogram, the success and failure counters (the failure's reason from errors.py), the
access log line `bitserve plan fit` reads, and the rollout statistics of its route. The
front-end fills in what it learns (`parsed`, `job`, `outputs`); the status comes from
how the block ends: 200, 499 (the client left) or the error's mapped status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import orjson

from bitserve.repository.version import ModelVersion
from bitserve.server.errors import reason_of, status_of
from bitserve.server.state import ServerState


@dataclass
class Record:
    status: int = 500
    parsed: Any = None  # the InferRequest, once parsed
    job: Any = None  # the batcher's request (queue and compute times), when batched
    outputs: Any = None


@contextlib.contextmanager
def recorded(state: ServerState, version: ModelVersion, route: Any) -> Iterator[Record]:
    labels = (version.config.name, str(version.version))
    record = Record()
    version.m["inflight"].inc()
    started = time.perf_counter()
    try:
        yield record
        record.status = 200
    except asyncio.CancelledError:  # the client left (or its deadline passed)
        record.status = 499
        raise
    except Exception as exc:
        record.status = status_of(exc)
        state.metrics.failure.labels(*labels, reason_of(exc)).inc()
        raise
    finally:
        version.m["inflight"].dec()
        seconds = time.perf_counter() - started
        version.m["duration"].observe(seconds)
        if state.options.access_log is not None:
            access_log(state.options.access_log, labels, record.status, seconds, record.job)
        if route is not None:
            route.finish(record.status, seconds, record.parsed, record.outputs)
    version.m["success"].inc()


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
