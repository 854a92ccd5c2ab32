"""Every error, once: which status each exception means, for every protocol front-end.

`STATUS` maps an exception class to its HTTP status and the reason label of
`bitserve_request_failure_total`; a protocol only chooses the shape of the body:
the v2 protocol's `{"error": "..."}`, or OpenAI's `{"error": {"message", "type",
"param", "code"}}` (`to_openai`). A gRPC front-end maps the same status to its codes.
An error that says when to come back (`retry_after`) gets a Retry-After header.
`handle(handler, shape)` is the one wrapper that turns a route's exceptions into
responses.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar

from starlette.requests import Request
from starlette.responses import Response

from bitserve.backends.llm import NoChatTemplate, Overloaded, PromptTooLong
from bitserve.batching.batcher import QueueFull, QueueTimeout
from bitserve.diffusion.engine import Overloaded as ImagesOverloaded
from bitserve.inference import ClientGone, InvalidRequest
from bitserve.llm.async_engine import EngineDead, RequestFailed
from bitserve.llm.sampling_params import SamplingError
from bitserve.repository.repository import ModelNotFound, ModelUnavailable
from bitserve.repository.version import ExecutionError, ReplicaLost
from bitserve.server.http import error, json_response

log = logging.getLogger("bitserve.server")


class APIError(Exception):
    """An error that carries its own status and OpenAI fields (type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.headers = headers


class BodyTooLarge(Exception):
    pass


class Draining(Exception):
    """The server is shutting down; it takes no new requests (503)."""


class Unauthorized(Exception):
    headers: ClassVar[dict] = {"WWW-Authenticate": "Bearer"}


class Forbidden(Exception):
    pass


# (exception, HTTP status, failure reason); the first match wins, so subclasses first.
STATUS: list[tuple[type[BaseException], int, str]] = [
    (PromptTooLong, 400, "invalid"),
    (NoChatTemplate, 400, "invalid"),
    (SamplingError, 400, "invalid"),
    (InvalidRequest, 400, "invalid"),
    (Unauthorized, 401, "invalid"),
    (Forbidden, 403, "invalid"),
    (ModelNotFound, 404, "other"),
    (BodyTooLarge, 413, "invalid"),
    (QueueFull, 429, "rejected"),
    (Overloaded, 429, "rejected"),
    (ImagesOverloaded, 429, "rejected"),
    (ClientGone, 499, "cancelled"),
    (ExecutionError, 500, "backend"),
    (RequestFailed, 500, "backend"),
    (ReplicaLost, 503, "backend"),
    (ModelUnavailable, 503, "unavailable"),
    (Draining, 503, "unavailable"),
    (EngineDead, 503, "unavailable"),
    (QueueTimeout, 504, "timeout"),
    (ValueError, 400, "invalid"),  # the engine's admission checks (RequestTooLong, ids)
]
EXPECTED = (ExecutionError, RequestFailed)  # 500s that were already logged where they arose
OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error"}
OPENAI_TYPES.update({401: "authentication_error", 403: "permission_error"})
OPENAI_TYPES.update({413: "invalid_request_error", 429: "rate_limit_error"})
OPENAI_TYPES.update({499: "cancelled", 503: "service_unavailable", 504: "timeout"})


def status_of(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    return next((status for cls, status, _ in STATUS if isinstance(exc, cls)), 500)


def reason_of(exc: BaseException) -> str:
    return next((reason for cls, _, reason in STATUS if isinstance(exc, cls)), "other")


def headers_of(exc: BaseException) -> dict | None:
    headers = dict(getattr(exc, "headers", None) or {})
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers.setdefault("Retry-After", str(retry_after))
    return headers or None


def to_openai(exc: BaseException) -> APIError:
    """The error in OpenAI's vocabulary (the API's routes and `bitserve batch`)."""
    if isinstance(exc, APIError):
        return exc
    status = status_of(exc)
    param = code = None
    if getattr(exc, "field", None):  # SamplingError, GuideError
        param = exc.field
    elif isinstance(exc, PromptTooLong):
        param, code = "messages", "context_length_exceeded"
    elif isinstance(exc, ModelNotFound):
        param, code = "model", "model_not_found"
    elif status == 429:
        code = "queue_full"
    message = str(exc) if status != 500 else f"{type(exc).__name__}: {exc}"
    kind = OPENAI_TYPES.get(status, "internal_error")
    return APIError(status, message, kind, param, code, headers_of(exc))


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
    """A route whose exceptions become responses of the protocol's shape."""
    body = SHAPES[shape]

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            if status_of(exc) == 500 and not isinstance(exc, EXPECTED):
                log.exception("internal error on %s", request.url.path, exc_info=exc)
            return body(exc)

    return wrapped
