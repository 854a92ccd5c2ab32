"""What every protocol front-end shares: the repository, the options, the metrics, the
traffic policies, and the drain. Each handler module takes this in `routes(state)`;
none imports another handler module or the app that assembles them."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import TextIO

from bitserve import coldstart
from bitserve.metrics import Metrics
from bitserve.repository.repository import Repository
from bitserve.repository.version import ModelVersion
from bitserve.rollout.state import Rollouts
from bitserve.rollout.state import Route as RolloutRoute
from bitserve.server.connections import ClientLimits
from bitserve.server.errors import Draining, Forbidden, Unauthorized
from bitserve.server.shm import SharedMemory

log = logging.getLogger("bitserve.server")

DEFAULT_MAX_BODY = 64 * 1024 * 1024  # Triton's --http-max-input-size


@dataclass
class ServerOptions:
    max_body: int = DEFAULT_MAX_BODY  # HTTP bodies and gRPC messages alike
    body_memory: int | None = None  # bytes of HTTP bodies served at once (None: 4 max_body)
    clients: ClientLimits = field(default_factory=ClientLimits)  # read and write timeouts
    grpc_address: str | None = None  # HOST:PORT of the v2 gRPC service (grpc_server.py)
    admin_token: str | None = None  # repository management is off without one
    model_control: str = "none"  # none | explicit | poll
    startup_models: list[str] | None = None  # explicit: what to load at start (None: all)
    poll_seconds: float = 15.0
    access_log: TextIO | None = None
    lazy_load: bool = False  # load each model on its first request (scale to zero)
    process_started: float = field(default_factory=coldstart.process_start_time)
    imported: float = field(default_factory=time.time)  # when serving code was importable


class ServerState:
    """The server's shared state. `drain` is what SIGTERM calls."""

    def __init__(self, repository: Repository, options: ServerOptions, metrics: Metrics):
        self.repository = repository
        self.options = options
        self.metrics = metrics
        self.rollout = Rollouts(repository, metrics)  # canary and shadow traffic
        self.shm = SharedMemory()  # the registered shared-memory regions (shm.py)
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def problems(self) -> list[str]:
        """Why the process is not live: each loaded version's problem (none: live)."""
        return [
            f"model '{name}' version {v.version}: {problem}"
            for name, entry in self.repository.models.items()
            for v in entry.versions.values()
            if (problem := v.problem())
        ]

    def not_ready(self) -> str | None:
        """Why the server should get no traffic (None: ready): draining, else the
        repository's reason (loading, a failed model, a restart)."""
        return "draining" if self.draining else self.repository.not_ready_reason()

    def route_model(
        self, model: str, pinned: str | None = None
    ) -> tuple[ModelVersion, RolloutRoute | None]:
        """The version that answers: a pinned one as asked, else the model's traffic
        policy's choice, else the highest ready version."""
        route = self.rollout.route(model) if pinned is None else None
        if route is not None:
            return route.version, route
        return self.repository.get(model, pinned), None

    def serving(self, model: str) -> ModelVersion:
        """The version that answers an unpinned request for `model` (the OpenAI-style
        routes): Draining, ModelNotFound or ModelUnavailable when there is none."""
        if self.draining:
            raise Draining("server is draining; send requests elsewhere")
        return self.route_model(model)[0]

    def authorize(self, authorization: str) -> None:
        """The admin token check of every protocol: `authorization` is the
        `Bearer <token>` the caller sent (HTTP header or gRPC metadata)."""
        token = self.options.admin_token
        if not token:
            raise Forbidden("repository management is off: start with --admin-token")
        if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("missing or wrong admin token")

    def allow_changes(self) -> None:
        """Loading or unloading models: refused in --model-control none and while
        draining."""
        if self.options.model_control == "none":
            raise Forbidden("model control mode is 'none': start with --model-control explicit")
        if self.draining:
            raise Forbidden("server is draining")

    def enter(self) -> None:
        """A request starts (the drain waits for it); refused while draining."""
        if self.draining:
            raise Draining("server is draining; send requests elsewhere")
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Turn unready, refuse new requests, wait for in-flight ones (False on timeout):
        those counted here (v2, gRPC) and every request that holds a lease on a version
        (OpenAI, generate, images, streams still sending), so none is cut at exit."""
        self.draining = True
        versions = [v for e in self.repository.models.values() for v in e.versions.values()]
        pending = self.inflight + sum(v.pending for v in versions)
        log.info("draining: waiting up to %.0f s for %d request(s)", timeout, pending)

        async def everything_idle() -> None:
            await self._idle.wait()
            await asyncio.gather(*(v.idle() for v in versions))

        try:
            await asyncio.wait_for(everything_idle(), timeout)
            return True
        except TimeoutError:
            pending = self.inflight + sum(v.pending for v in versions)
            log.error("drain timed out with %d request(s) in flight", pending)
            return False
