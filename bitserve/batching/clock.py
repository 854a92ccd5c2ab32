"""Time for the batcher: the event loop's clock in the server, a manual one in tests.

The batcher never sleeps or polls; it asks the clock to call it back at the one instant
something can change (the oldest request's batching deadline, or the earliest request
timeout). Tests inject `ManualClock` and move time by hand, so every batch size and
waiting time is exact and no test sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...


class LoopClock:
    """The asyncio loop's monotonic clock and timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    def now(self) -> float:
        return self._loop.time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return self._loop.call_at(when, callback)


class _ManualTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when `advance` is called; due timers fire in order."""

    def __init__(self, start: float = 0.0):
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer()
        heapq.heappush(self._timers, (when, next(self._seq), timer, callback))
        return timer

    def advance(self, seconds: float) -> None:
        self.advance_to(self._now + seconds)

    def advance_to(self, end: float) -> None:
        while self._timers and self._timers[0][0] <= end:
            when, _, timer, callback = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._now = max(self._now, when)
                callback()
        self._now = end

    def pending(self) -> list[float]:
        """Times of the timers still armed (for assertions)."""
        return sorted(w for w, _, t, _ in self._timers if not t.cancelled)
