"""HTTP plumbing every route module shares: JSON bodies and responses, v2 errors, the
version a request pins, and waiting on work while watching for the client to leave."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from bitserve import tracing
from bitserve.rollout.policy import VERSION_HEADER


def json_response(doc: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def error(status: int, message: str, headers: dict | None = None) -> Response:
    """The v2 protocol's error body: `{"error": "..."}`."""
    return json_response({"error": message}, status, headers)


def pinned_version(request: Request) -> str | None:
    """The version a v2 request asks for: in its path, or in the rollout header (None:
    the model's traffic policy or its highest ready version answers)."""
    return request.path_params.get("version") or request.headers.get(VERSION_HEADER)


async def traced(app: Any, scope: dict, receive: Any, send: Any) -> None:
    """Serve one HTTP request inside its tracing span (tracing.server_span), which
    lasts until the response's last byte, a stream's too, and gets its status."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    method, path = scope["method"], scope["path"]
    attributes = {"http.request.method": method, "url.path": path}
    with tracing.server_span(f"{method} {path}", headers, attributes) as span:

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        await app(scope, receive, sending)


async def until_disconnect(
    http: Request, awaitable: Awaitable, on_disconnect: Callable[[], Any] | None = None
) -> Any:
    """Await `awaitable`; if the client goes away first, call `on_disconnect` (by default
    cancel the work). A done-callback on the watcher, not asyncio.wait, keeps the common
    path to one extra task."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.get_running_loop().create_task(_disconnected(http))

    def gone(task: asyncio.Task) -> None:
        if not task.cancelled() and not work.done():
            (on_disconnect or work.cancel)()

    watcher.add_done_callback(gone)
    try:
        return await work
    finally:
        watcher.cancel()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
