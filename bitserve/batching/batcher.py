"""The dynamic batcher of one model version: queue, priorities, timeouts, dispatch.

Triton's semantics, event-driven. A batch leaves for a free instance when

1. the queue holds `max_batch_size` rows, or
2. it can form one of `preferred_batch_sizes` (the largest it can), or
3. its oldest request has waited `max_queue_delay_ms` since *its arrival*, or
4. (`dispatch_when_idle`) a request arrives to an empty queue and an instance is free:
   nothing can be batched with it, so waiting would only add latency.

Otherwise one timer is armed for the instant the answer can change: the oldest
request's deadline or the earliest request timeout, whichever is first. Requests leave
highest priority level first, FIFO within a level. A full queue rejects at once; a
request whose timeout passes while queued is rejected and never executed; a cancelled
request (its client went away) leaves the queue.

The batcher itself is synchronous and knows nothing of threads or HTTP: `execute(slot,
batch)` starts a batch on instance `slot`, and whoever runs it calls `release(slot)`
when it is done. That keeps it exactly testable with `clock.ManualClock`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bitserve.batching.clock import Clock, Timer
from bitserve.config import DynamicBatching


class QueueFull(Exception):
    """The model's queue is at `max_queue_size`; `retry_after` is a whole-second hint."""

    def __init__(self, model: str, retry_after: int):
        super().__init__(f"model '{model}': queue is full, retry later")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    """The request's timeout passed while it waited in the queue; it was never run."""


_seq = itertools.count()


@dataclass(eq=False)
class Request:
    """One caller's inference request as the batcher sees it."""

    inputs: dict[str, Any]
    rows: int  # the request's own batch dimension
    arrival: float
    priority: int = 1  # 1 is the highest level
    timeout_at: float | None = None
    # Requests batch together only when their fixed-shape inputs agree.
    shape_key: tuple = ()
    # Called once with (outputs, None) or (None, error).
    on_done: Callable[[Any, BaseException | None], None] = lambda out, err: None
    seq: int = field(default_factory=lambda: next(_seq))
    state: str = "new"  # new -> queued -> running -> done | cancelled
    # Filled in on the way, for metrics and the access log.
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    batch_rows: int = 0

    def finish(self, outputs: Any = None, error: BaseException | None = None) -> None:
        if self.state != "done":
            self.state = "done"
            self.on_done(outputs, error)


@dataclass
class BatchStats:
    """Triton-style counters: rows inferred, batches run, and rows per batch."""

    inference_count: int = 0
    execution_count: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    queue_seconds: float = 0.0
    rejected_full: int = 0
    rejected_timeout: int = 0
    cancelled: int = 0


class DynamicBatcher:
    def __init__(
        self,
        name: str,
        max_batch_size: int,
        policy: DynamicBatching | None,
        instances: int,
        execute: Callable[[int, list[Request]], None],
        clock: Clock,
    ):
        # Without a dynamic_batching block every request runs alone, as in Triton.
        self.name = name
        self.batching = policy is not None
        self.policy = policy or DynamicBatching()
        self.max_rows = max(max_batch_size, 1)
        self.preferred = sorted(self.policy.preferred_batch_sizes, reverse=True)
        self.delay = self.policy.max_queue_delay_ms / 1000.0
        self.execute = execute
        self.clock = clock
        self.levels: list[deque[Request]] = [deque() for _ in range(self.policy.priority_levels)]
        self.free = list(range(instances - 1, -1, -1))  # pop() gives instance 0 first
        self.queued_rows = 0
        self.queued = 0
        self.stats = BatchStats()
        self._timeouts: list[tuple[float, int, Request]] = []
        self._timer: Timer | None = None
        self._timer_at: float | None = None
        self._exec_ewma = 0.0  # seconds per batch, for Retry-After
        self._started: dict[int, float] = {}

    # ----------------------------------------------------------------- callers

    def submit(self, request: Request) -> None:
        """Queue a request (or run it at once); raises QueueFull."""
        limit = self.policy.max_queue_size
        if limit and self.queued >= limit:
            self.stats.rejected_full += 1
            raise QueueFull(self.name, self.retry_after())
        was_empty = self.queued == 0
        self._enqueue(request)
        self._schedule(eager=was_empty and self.policy.dispatch_when_idle)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        request.state = "queued"
        level = self.levels[request.priority - 1]
        if front:
            level.appendleft(request)
        else:
            level.append(request)
        self.queued += 1
        self.queued_rows += request.rows
        if request.timeout_at is not None:
            heapq.heappush(self._timeouts, (request.timeout_at, request.seq, request))

    def cancel(self, request: Request) -> bool:
        """Remove a request that has not started; True if it was still queued."""
        if request.state != "queued":
            return False
        self._unqueue(request)
        self.levels[request.priority - 1].remove(request)
        request.state = "cancelled"
        self.stats.cancelled += 1
        self._schedule(eager=False)
        return True

    def requeue(self, batch: list[Request]) -> None:
        """Put a dispatched batch that never started back at the head of the queue (its
        Ray replica died first); it keeps its arrival time, so it leaves first again."""
        for request in reversed(batch):
            if request.state == "running":
                self._enqueue(request, front=True)
        self._schedule(eager=False)

    def release(self, slot: int) -> None:
        """Instance `slot` finished its batch."""
        started = self._started.pop(slot, None)
        if started is not None:
            spent = self.clock.now() - started
            self._exec_ewma = spent if not self._exec_ewma else 0.8 * self._exec_ewma + 0.2 * spent
        self.free.append(slot)
        self._schedule(eager=False)

    def retry_after(self) -> int:
        """Whole seconds until the queue has likely drained, at least 1."""
        batches = math.ceil(self.queued_rows / self.max_rows)
        return max(1, math.ceil(batches * self._exec_ewma / max(len(self._started), 1)))

    # ---------------------------------------------------------------- dispatch

    def _schedule(self, eager: bool) -> None:
        now = self.clock.now()
        self._expire(now)
        while self.free and self.queued:
            size = self._ready_size(now, eager)
            if size is None:
                break
            self._dispatch(self._take(size), now)
        self._arm_timer()

    def _ready_size(self, now: float, eager: bool) -> int | None:
        """How many rows to send now, or None to keep waiting."""
        if not self.batching:
            return 1  # one request, whatever its rows
        if self.queued_rows >= self.max_rows:
            return self.max_rows
        for size in self.preferred:
            if size <= self.queued_rows:
                return size
        if eager or self._oldest().arrival + self.delay <= now:
            return self.max_rows
        return None

    def _take(self, rows: int) -> list[Request]:
        """Up to `rows` rows, highest level first, FIFO, stopping where shapes differ."""
        batch: list[Request] = []
        total = 0
        for level in self.levels:
            while level:
                head = level[0]
                fits = total + head.rows <= rows or not batch
                if not fits or (batch and head.shape_key != batch[0].shape_key):
                    return batch
                batch.append(level.popleft())
                total += head.rows
                if not self.batching:
                    return batch
        return batch

    def _dispatch(self, batch: list[Request], now: float) -> None:
        slot = self.free.pop()
        rows = 0
        for request in batch:
            self._unqueue(request)
            request.state = "running"
            self.stats.queue_seconds += now - request.arrival
            rows += request.rows
        self.stats.execution_count += 1
        self.stats.inference_count += rows
        self.stats.batch_sizes[rows] = self.stats.batch_sizes.get(rows, 0) + 1
        self._started[slot] = now
        self.execute(slot, batch)

    def _unqueue(self, request: Request) -> None:
        self.queued -= 1
        self.queued_rows -= request.rows

    def _oldest(self) -> Request:
        return min((level[0] for level in self.levels if level), key=lambda r: r.arrival)

    # ------------------------------------------------------------ time events

    def _expire(self, now: float) -> None:
        while self._timeouts and self._timeouts[0][0] <= now:
            _, _, request = heapq.heappop(self._timeouts)
            if request.state != "queued":
                continue
            self._unqueue(request)
            self.levels[request.priority - 1].remove(request)
            self.stats.rejected_timeout += 1
            request.finish(None, QueueTimeout(f"model '{self.name}': request timed out in queue"))

    def _arm_timer(self) -> None:
        while self._timeouts and self._timeouts[0][2].state != "queued":
            heapq.heappop(self._timeouts)
        candidates = []
        if self._timeouts:
            candidates.append(self._timeouts[0][0])
        if self.queued and self.free and self.batching:
            candidates.append(self._oldest().arrival + self.delay)
        when = min(candidates) if candidates else None
        if when == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, when
        if when is not None:
            self._timer = self.clock.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._schedule(eager=False)
