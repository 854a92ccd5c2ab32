"""Errors as HTTP responses: the body's shape per protocol, and the one wrapper that
turns a route's exceptions into responses.

Which status an exception means is decided once, for every protocol and for batch
jobs, in bitserve/api/errors.py (a lookup along the exception's MRO); here a protocol
only chooses the body: the v2 protocol's `{"error": "..."}`, or OpenAI's
`{"error": {"message", "type", "param", "code"}}`. A gRPC front-end maps the same
status to its codes (grpc_protocol.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from bitserve.api.errors import (
    EXPECTED,
    APIError,
    BodyTooLarge,
    Draining,
    Forbidden,
    Unauthorized,
    headers_of,
    is_bug,
    reason_of,
    status_of,
    to_openai,
)
from bitserve.inference import ClientGone
from bitserve.server.http import error, json_response

__all__ = [
    "EXPECTED",
    "APIError",
    "BodyTooLarge",
    "Draining",
    "Forbidden",
    "Unauthorized",
    "handle",
    "headers_of",
    "openai_body",
    "reason_of",
    "status_of",
    "to_openai",
    "v2_body",
]

log = logging.getLogger("bitserve.server")


def v2_body(exc: BaseException) -> Response:
    return error(status_of(exc), str(exc) or type(exc).__name__, headers_of(exc))


def openai_body(exc: BaseException) -> Response:
    e = to_openai(exc)
    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code}}
    return json_response(body, e.status, e.headers)


SHAPES = {"v2": v2_body, "openai": openai_body}


def handle(
    handler: Callable[[Request], Awaitable[Response]], shape: str = "v2"
) -> Callable[[Request], Awaitable[Response]]:
    """A route whose exceptions become responses of the protocol's shape; a bug (an
    exception no domain error names) is a 500 whose traceback is logged."""
    body = SHAPES[shape]

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            if isinstance(exc, ClientDisconnect):  # it left mid-body (or timed out: connections.py)
                exc = ClientGone("the client left while sending its body")
            if is_bug(exc):
                log.exception("internal error on %s", request.url.path, exc_info=exc)
            return body(exc)

    return wrapped
