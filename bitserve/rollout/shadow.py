"""Shadow traffic: a bounded queue of mirrored requests and the workers that run them.

The primary answers first; only then is a copy offered to the shadow, with
`put_nowait` on a bounded queue. A full queue drops the copy (counted in
`bitserve_shadow_mirrors_dropped`), so a slow or failing shadow can never delay or fail
the primary: nothing on the primary's path waits for it. A fixed number of workers
take copies off the queue and run them on the shadow version at its lowest priority.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bitserve.inference import InferRequest
from bitserve.repository.version import ModelVersion

log = logging.getLogger("bitserve.rollout")


@dataclass
class MirrorJob:
    shadow: ModelVersion
    parsed: InferRequest  # the primary's request (inputs are read, never written)
    primary: int
    primary_seconds: float
    primary_ok: bool
    primary_outputs: dict | None


class Mirror:
    def __init__(
        self,
        size: int,
        workers: int,
        handle: Callable[[MirrorJob], Awaitable[None]],
        sent: Any,
        dropped: Any,
    ):
        self.queue: asyncio.Queue[MirrorJob] = asyncio.Queue(size)
        self.workers = workers
        self.handle = handle
        self.sent, self.dropped = sent, dropped
        self.tasks: list[asyncio.Task] = []

    def offer(self, job: MirrorJob) -> bool:
        """Queue a copy if there is room; never waits."""
        if not self.tasks:
            self.tasks = [asyncio.ensure_future(self._work()) for _ in range(self.workers)]
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.dropped.inc()
            return False
        self.sent.inc()
        return True

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self.handle(job)
            except Exception:  # a shadow's failure is recorded, never raised
                log.exception("shadow mirror of model %s failed", job.shadow.config.name)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks = []


async def run(version: ModelVersion, parsed: InferRequest) -> dict:
    """Run the primary's request on the shadow version: the one request path, at the
    lowest priority and with no client to watch."""
    return await version.infer(parsed, background=True)
