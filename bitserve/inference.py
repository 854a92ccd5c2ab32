"""One inference request, whatever brought it: the v2 protocol over HTTP, the shadow
mirror, a batch job or a future protocol front-end all hand a model version an
`InferRequest` (`ModelVersion.start` / `infer`), so none of them needs another.

Protocol modules turn their wire format into this and the outputs back into theirs;
the errors here are the caller's and the client's, named once for every protocol
(bitserve/api/errors.py maps them to status codes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """The caller's mistake (HTTP 400, gRPC INVALID_ARGUMENT); the message names the field."""


class ClientGone(Exception):
    """The client went away while its request was queued (nginx's 499)."""


class Overloaded(Exception):
    """A model's waiting queue is full (HTTP 429, gRPC RESOURCE_EXHAUSTED); `retry_after` is a
    whole-second hint for the Retry-After header."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    rows: int
    shape_key: tuple
    id: str | None = None
    outputs: list[str] = field(default_factory=list)  # requested names, in order
    binary: dict[str, bool] = field(default_factory=dict)  # per-output binary choice
    classification: dict[str, int] = field(default_factory=dict)  # output -> top k
    priority: int = 0  # 0: the model's default level
    timeout_us: int = 0  # 0: the model's default queue timeout
