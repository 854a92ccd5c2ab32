"""The contract every kind of model keeps with its version (vLLM v1's
`SchedulerInterface` shape): start a request, await or cancel its result, say what it
serves, report, be watched, stop.

A front-end, the shadow mirror or a batch job holds a `ModelVersion` and calls its path
through it; none of them asks what kind of model it is. What differs by kind is only
which tasks a path serves (`tasks`, vLLM's `supported_tasks`) and the interface it hands
out for one (`serving`): "infer" (v2 tensors in and out) for every kind, "generate"
(the LLM front door, backends/llm.py), "embed", "score" (an hf cross-encoder's pairs),
"images" (the diffusion step loop).
Asking a path for a task it does not serve is the caller's mistake: `NotSupported`, a
400 naming the model.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bitserve import coldstart
from bitserve.inference import InferRequest, InvalidRequest

if TYPE_CHECKING:
    from bitserve.batching.batcher import BatchStats, Request

# the tasks each backend's models serve beyond v2 infer (read before a model loads, too:
# the published schema lists each endpoint's models)
TASKS = {"llm": {"generate"}, "hf": {"embed"}, "diffusion": {"images"}}
WORDS = {"generate": "a text generation", "embed": "an embedding", "images": "an image"}
WORDS["score"] = "a cross-encoder (rerank and score)"


def tasks_of(backend: str, parameters: dict | None = None) -> frozenset[str]:
    """What a model of `backend` serves: "infer", and "generate", "embed", "score" or
    "images" (an hf model with `parameters.task = "cross-encoder"` scores pairs)."""
    if backend == "hf" and (parameters or {}).get("task") == "cross-encoder":
        return frozenset({"infer", "score"})
    return frozenset({"infer", *TASKS.get(backend, ())})


class NotSupported(InvalidRequest):
    """The model does not serve this task (400; OpenAI's `param` is "model")."""

    field = "model"


@dataclass
class Ticket:
    """A started inference: `result` resolves to the outputs by name (or raises);
    `cancel(error)` takes it back if it has not started running (a client that left);
    `job` is the batcher's request, for the access log (None off the batcher)."""

    result: asyncio.Future
    cancel: Any
    job: Request | None = None


@dataclass
class Report:
    """What a path reports for statistics and metrics; a part it has not is None."""

    batch: BatchStats | None = None  # the dynamic batcher's counters
    queued: int = 0  # requests in the batcher's queue
    healthy: int = 0  # instances alive
    restarts: dict[str, int] = field(default_factory=dict)  # instance restarts by reason
    retried: int = 0  # requests requeued because their Ray replica died first
    engine: dict | None = None  # the LLM engine's metrics snapshot
    engine_restarts: int = 0  # the LLM engine's supervised restarts


class ExecutionPath:
    """One kind of model's way of running requests; `version` owns its lifecycle."""

    platform = "unknown"

    def __init__(self, version: Any):
        self.version = version  # the ModelVersion (its lifecycle, drain and metrics)
        self.config = version.config
        self.tasks = tasks_of(self.config.backend, self.config.parameters)

    async def load(self) -> tuple[list[tuple[coldstart.Span, coldstart.Span]], float]:
        """Start and warm up; the (load, warm-up) spans of each instance, and the warm-up
        seconds. Raises (LoadError or anything) when the model cannot serve."""
        raise NotImplementedError

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        """Begin one v2 inference; raises InvalidRequest or a full queue's error before
        anything is queued. `background` (the shadow mirror): the lowest priority."""
        raise NotImplementedError

    def serving(self, task: str) -> Any:
        """The interface of `task` ("generate", "embed", "score", "images"), or NotSupported."""
        raise self.unsupported(task)

    def unsupported(self, task: str, why: str = "") -> NotSupported:
        return NotSupported(f"model '{self.config.name}' is not {WORDS[task]} model{why}")

    def ready(self) -> bool:
        """Whether the path can answer now (the version's state aside)."""
        return True

    def degraded(self) -> str | None:
        return None

    def problem(self) -> str | None:
        """Why liveness should fail (None when healthy)."""
        return None

    def restarting(self) -> str | None:
        """What is being restarted now, in a few words (None when nothing is)."""
        return None

    def report(self) -> Report:
        return Report()

    def describe(self) -> str:
        """A few words on what loading did, for the log."""
        return ""

    def check(self) -> list[tuple[int, str]]:
        """(slot, why) of instances the watchdog should restart."""
        return []

    async def restart(self, slot: int, reason: str) -> None:
        return None

    async def stop(self) -> None:
        return None
