"""Ray Serve's autoscaling rule, one copy for batched models' Ray replicas
(`replica.Autoscaler`) and LLM replicas (`llmreplicas.RayLLMService`).

The count aims at ongoing requests (queued and running) over `target_ongoing_requests`
per replica, clamped to [min_replicas, max_replicas]. A change is made once the same
wanted count has held for `upscale_delay_s` (more) or `downscale_delay_s` (fewer); from
zero replicas the delay is not waited, since a request is already waiting for one.
"""

from __future__ import annotations

import math
import time

from bitserve.config import Autoscaling


class ScalingRule:
    def __init__(self, scaling: Autoscaling):
        self.scaling = scaling
        self._since: tuple[int, float] | None = None  # (wanted count, since when)

    def wanted(self, ongoing: int) -> int:
        s = self.scaling
        return min(
            max(math.ceil(ongoing / s.target_ongoing_requests), s.min_replicas), s.max_replicas
        )

    def change(self, ongoing: int, have: int, now: float | None = None) -> int:
        """Replicas to add (> 0) or to take away (< 0) now; 0 while none is wanted or a
        wanted change is still waiting out its delay."""
        wanted = self.wanted(ongoing)
        if wanted == have:
            self._since = None
            return 0
        now = time.monotonic() if now is None else now
        if self._since is None or self._since[0] != wanted:
            self._since = (wanted, now)
        delay = self.scaling.upscale_delay_s if wanted > have else self.scaling.downscale_delay_s
        if have > 0 and now - self._since[1] < delay:
            return 0
        self._since = None
        return wanted - have
