"""Every error, once: which status each exception means, for every protocol.

`STATUS` maps an exception class to its HTTP status and the reason label of
`bitserve_request_failure_total`. An exception is looked up along its class's MRO (its
own class first, then its bases: Starlette's `_lookup_exception_handler`), so a
subclass needs no entry of its own and the table has no order. Anything not in it is
a bug: a 500, logged where it is answered. A protocol only chooses the body's shape:
v2's `{"error": "..."}`, OpenAI's `{"error": {"message", "type", "param", "code"}}`
(`to_openai`), or a gRPC status code (server/grpc_protocol.py). An error that says
when to come back (`retry_after`) gets a Retry-After header.
"""

from __future__ import annotations

from typing import ClassVar

from bitserve.batching.batcher import QueueFull, QueueTimeout
from bitserve.diffusion.engine import EngineStopped
from bitserve.inference import ClientGone, InvalidRequest, Overloaded
from bitserve.llm.async_engine import EngineDead, RequestFailed
from bitserve.llm.sampling_params import SamplingError
from bitserve.llm.scheduler import RequestTooLong
from bitserve.llm.structured import GuideError
from bitserve.repository.repository import ModelNotFound, ModelUnavailable
from bitserve.repository.version import ExecutionError, ReplicaLost
from bitserve.tensors import TensorError


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
    """The request body is past --max-body-size (413)."""


class Draining(Exception):
    """The server is shutting down; it takes no new requests (503)."""


class Unauthorized(Exception):
    headers: ClassVar[dict] = {"WWW-Authenticate": "Bearer"}


class Forbidden(Exception):
    pass


# exception class -> (HTTP status, failure reason); looked up along the MRO
STATUS: dict[type[BaseException], tuple[int, str]] = {
    InvalidRequest: (400, "invalid"),  # RequestTooLong, NoChatTemplate, InvalidParams, ...
    SamplingError: (400, "invalid"),
    GuideError: (400, "invalid"),
    RequestTooLong: (400, "invalid"),
    TensorError: (400, "invalid"),
    Unauthorized: (401, "invalid"),
    Forbidden: (403, "invalid"),
    ModelNotFound: (404, "other"),
    BodyTooLarge: (413, "invalid"),
    QueueFull: (429, "rejected"),
    Overloaded: (429, "rejected"),
    ClientGone: (499, "cancelled"),
    ExecutionError: (500, "backend"),
    RequestFailed: (500, "backend"),
    ReplicaLost: (503, "backend"),
    ModelUnavailable: (503, "unavailable"),
    Draining: (503, "unavailable"),
    EngineDead: (503, "unavailable"),
    EngineStopped: (503, "unavailable"),
    QueueTimeout: (504, "timeout"),
}
UNKNOWN = (500, "other")  # not a domain error: a bug
EXPECTED = (ExecutionError, RequestFailed)  # 500s that were already logged where they arose
OPENAI_TYPES = {400: "invalid_request_error", 404: "invalid_request_error"}
OPENAI_TYPES.update({401: "authentication_error", 403: "permission_error"})
OPENAI_TYPES.update({413: "invalid_request_error", 429: "rate_limit_error"})
OPENAI_TYPES.update({499: "cancelled", 503: "service_unavailable", 504: "timeout"})


def lookup(exc: BaseException) -> tuple[int, str]:
    """(status, reason) of the nearest class in the exception's MRO that STATUS names."""
    for cls in type(exc).__mro__:
        found = STATUS.get(cls)
        if found is not None:
            return found
    return UNKNOWN


def status_of(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    return lookup(exc)[0]


def reason_of(exc: BaseException) -> str:
    return lookup(exc)[1]


def is_bug(exc: BaseException) -> bool:
    """A 500 nobody logged yet: the front-end that answers it logs its traceback."""
    return status_of(exc) == 500 and not isinstance(exc, EXPECTED)


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
    elif isinstance(exc, RequestTooLong):
        param, code = "messages", "context_length_exceeded"
    elif isinstance(exc, ModelNotFound):
        param, code = "model", "model_not_found"
    elif status == 429:
        code = "queue_full"
    message = str(exc) if status != 500 else f"{type(exc).__name__}: {exc}"
    kind = OPENAI_TYPES.get(status, "internal_error")
    return APIError(status, message, kind, param, code, headers_of(exc))
