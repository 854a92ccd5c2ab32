"""One version's latest requests: the fixed window the statistics read.

Memory is bounded by a fixed window (the latest `window` requests, 10,000 by default),
not a reservoir: a rollout asks how the version behaves now, and a reservoir would keep
requests from long ago with the same weight. Totals since the policy was loaded are
kept beside it.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Window:
    """One version's latest requests: (seconds, ok) in a fixed window, plus totals."""

    def __init__(self, size: int):
        self.samples: deque[tuple[float, bool]] = deque(maxlen=size)
        self.requests = 0
        self.errors = 0
        self._window_errors = 0  # kept as samples enter and leave: O(1) per request

    def add(self, seconds: float, ok: bool) -> None:
        if len(self.samples) == self.samples.maxlen:
            self._window_errors -= not self.samples[0][1]  # about to be evicted
        self.samples.append((seconds, ok))
        self._window_errors += not ok
        self.requests += 1
        self.errors += not ok

    def resize(self, size: int) -> None:
        """A new window length; the latest samples stay."""
        if size != self.samples.maxlen:
            self.samples = deque(self.samples, maxlen=size)
            self._window_errors = sum(not ok for _, ok in self.samples)

    def copy(self) -> Window:
        twin = Window(self.samples.maxlen or 1)
        twin.samples.extend(self.samples)
        twin.requests, twin.errors = self.requests, self.errors
        twin._window_errors = self._window_errors
        return twin

    def __len__(self) -> int:
        return len(self.samples)

    def window_errors(self) -> int:
        return self._window_errors

    def latencies(self) -> np.ndarray:
        """Seconds of the successful requests in the window (a failure's latency says
        how fast it failed, not how fast the model is)."""
        return np.array([s for s, ok in self.samples if ok], dtype=np.float64)
