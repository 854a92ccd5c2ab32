"""One inference request, whatever brought it: the v2 protocol over HTTP, the shadow
mirror, a batch job or a future protocol front-end all hand a model version an
`InferRequest` (`ModelVersion.start` / `infer`), so none of them needs another.

Protocol modules turn their wire format into this and the outputs back into theirs;
the errors here are the caller's and the client's, named once for every protocol
(bitserve/api/errors.py maps them to status codes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson


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
    shm: dict[str, Any] = field(default_factory=dict)  # output -> its shared-memory Placement
    priority: int = 0  # 0: the model's default level
    timeout_us: int = 0  # 0: the model's default queue timeout


def text_inputs(inputs: dict[str, np.ndarray]) -> tuple[str, Any]:
    """An llm model's v2 inputs (config.py declares them, as Triton's vLLM backend does):
    the prompt in `text_input` and the JSON object of the optional `sampling_parameters`.
    Here, below the backends and the protocols, so that both can read them alike."""
    raw = inputs.get("sampling_parameters")
    parameters = _json(_one(raw, "sampling_parameters")) if raw is not None else {}
    return _one(inputs["text_input"], "text_input"), parameters


def _one(array: np.ndarray, name: str) -> str:
    if array.size != 1:
        raise InvalidRequest(f"input '{name}' takes one element")
    item = array.reshape(-1)[0]
    try:
        return item.decode() if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' is not UTF-8") from None


def _json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"input 'sampling_parameters' is not JSON: {e}") from None
