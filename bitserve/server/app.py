"""The HTTP app: it only assembles. Each protocol front-end is one module exposing
`routes(state)` over the shared `ServerState` (state.py): v2 (v2.py, wire format in
bitserve/api/v2.py), Triton's generate extension (generate.py), the OpenAI API (openai.py,
wire format in bitserve/api/openai.py), rerank and score (rerank.py, wire format in
bitserve/api/rerank.py), images (images.py), the repository extension
(admin.py), health (health.py), metrics (metrics.py) and the web console (console.py).
Errors map once, in bitserve/api/errors.py; every request reaches its model through its
version's execution path (repository/paths/). A new front-end is one module and one line
below.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.routing import Router

from bitserve import tracing
from bitserve.metrics import Metrics
from bitserve.repository.repository import Repository
from bitserve.server import (
    admin,
    console,
    generate,
    grpc_server,
    health,
    images,
    lora,
    openai,
    rerank,
    shm,
    startup,
    v2,
)
from bitserve.server import metrics as server_metrics
from bitserve.server.admission import Admission
from bitserve.server.http import error, traced
from bitserve.server.state import ServerOptions, ServerState

log = logging.getLogger("bitserve.server")
# in order
FRONT_ENDS = (
    v2,
    openai,
    lora,
    rerank,
    generate,
    images,
    health,
    server_metrics,
    admin,
    shm,
    console,
)


class App:
    """The ASGI app: a bare Starlette Router (the handlers turn their own errors into
    responses, so Starlette's exception middlewares would only add cost per request)."""

    def __init__(self, server: ServerState, router: Router):
        self.server = server
        self.router = router
        self.admission = Admission(server)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.router(scope, receive, send)
        # bodies past their limits and LLMs with a full queue refuse before the router
        app = functools.partial(traced, self.router) if tracing.enabled() else self.router
        await self.admission(app, scope, receive, send)


def create_app(
    repository: Repository,
    options: ServerOptions | None = None,
    metrics: Metrics | None = None,
    load: bool = True,
) -> App:
    """The ASGI app. With `load`, models load in the background after startup so that
    health answers (live, not ready) while they load."""
    options = options or ServerOptions()
    repository.metrics = metrics or repository.metrics
    state = ServerState(repository, options, repository.metrics)
    repository.metrics.add_collector(functools.partial(server_metrics.collect, state))
    routes = [route for front_end in FRONT_ENDS for route in front_end.routes(state)]

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(health.Health(state).watchdog())]
        tasks += await grpc_server.start(state)  # the v2 gRPC service, when asked for
        if load:
            loading = asyncio.create_task(startup.load(repository, options))
            loading.add_done_callback(_log_failure)
            tasks.append(loading)
        yield
        for task in tasks:
            task.cancel()
        state.rollout.close()
        await repository.unload_all()

    return App(state, Router(routes=routes, lifespan=lifespan, default=_not_found))


async def _not_found(scope: dict, receive: Any, send: Any) -> None:
    response = error(404, f"{scope['method']} {scope['path']}: no such route")
    await response(scope, receive, send)


def _log_failure(task: asyncio.Task) -> None:
    """A background task that dies says so (else the server would stay unready, silent)."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.error("%s failed", task.get_coro().__name__, exc_info=e)
