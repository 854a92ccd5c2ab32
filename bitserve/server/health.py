"""Health as a traffic gate, not a heartbeat.

- live (`/v2/health/live`, `/livez`): 503 while any instance is dead or wedged (a batch
  past its execution timeout). A watchdog notices within a quarter second, fails the
  batch the instance held, and restarts it; live turns 200 again once it is back.
- ready (`/v2/health/ready`, `/readyz`): 200 only when every model the repository asks
  for is loaded and warmed, no instance is restarting, and the server is not draining.
  Ray replicas are the exception: a model stays ready while one replica is healthy, and
  the body lists the others being replaced (`"degraded"`); it is not ready with none.
- startup (`/startupz`): 503 "loading" while models load, 500 naming the model when one
  is broken, 200 once everything loaded. Kubernetes can tell slow from broken.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.server.http import error, json_response
from bitserve.server.state import ServerState

log = logging.getLogger("bitserve.server")

WATCHDOG_PERIOD_S = 0.25


def routes(state: ServerState) -> list[Route]:
    probes = Health(state)
    return [
        Route("/v2/health/live", probes.live),
        Route("/livez", probes.live),
        Route("/v2/health/ready", probes.ready),
        Route("/readyz", probes.ready),
        Route("/startupz", probes.startup),
    ]


class Health:
    def __init__(self, state: ServerState):
        self.server = state

    async def live(self, request: Request) -> Response:
        sick = self.server.problems()
        return _answer(200 if not sick else 503, "; ".join(sick))

    async def ready(self, request: Request) -> Response:
        reason = self.server.not_ready()
        lazy = self.server.repository.lazy_models()
        degraded = [
            f"model '{name}' version {v.version}: {why}"
            for name, entry in self.server.repository.models.items()
            for v in entry.versions.values()
            if (why := v.degraded())
        ]
        if reason is None and (lazy or degraded):  # ready, and it says what is missing
            body: dict = {"ready": True}
            if lazy:
                body["lazy_models"] = lazy
            if degraded:  # Ray replicas being replaced while the others serve
                body["degraded"] = degraded
            return json_response(body)
        return _answer(200 if reason is None else 503, reason or "")

    async def startup(self, request: Request) -> Response:
        repository = self.server.repository
        broken = [f"model '{e.name}': {e.error}" for e in repository.models.values() if e.error]
        if broken:
            return _answer(500, "; ".join(broken))
        return _answer(200 if repository.loaded else 503, "" if repository.loaded else "loading")

    async def watchdog(self) -> None:
        """Restart dead or wedged instances; one restart per slot at a time."""
        restarting: set[tuple[Any, int]] = set()
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            for entry in list(self.server.repository.models.values()):
                for version in list(entry.versions.values()):
                    if version.state not in ("ready", "draining"):
                        continue
                    for slot, why in version.check():
                        key = (version, slot)
                        if key not in restarting:
                            restarting.add(key)
                            task = asyncio.create_task(version.restart(slot, why))
                            task.add_done_callback(lambda _, key=key: restarting.discard(key))


def _answer(status: int, reason: str) -> Response:
    if status == 200:
        return Response(status_code=200)
    return error(status, reason)
