"""One served model version: its lifecycle, its drain and its metrics; requests go to
its execution path (repository/paths/).

States: loading → ready → draining → unloaded, or loading → failed. A version is ready
while its state is and its path can answer (every instance alive, or the LLM engine
not restarting); `problem` says why liveness should fail. The drain waits for every
request a path started (each holds a `Lease` on the version).

`start(request)` is the one request path below the protocols: a batched model, an LLM
and a diffusion model alike take an `InferRequest` and give a `Ticket` whose result is
the outputs by name. A task beyond v2 infer ("generate", "embed", "images") is asked
for by name (`serving(task)`), never by the kind of model; HTTP, gRPC, the shadow
mirror and batch jobs all come through here.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

from bitserve import coldstart, tracing
from bitserve.backends import preimport
from bitserve.backends.base import LoadError
from bitserve.config import ModelConfig
from bitserve.inference import InferRequest
from bitserve.metrics import Metrics
from bitserve.repository.cache import ResponseCache
from bitserve.repository.paths import ExecutionPath, Report, Ticket, path_for
from bitserve.repository.paths.batched import ExecutionError, ReplicaLost

__all__ = ["ExecutionError", "Lease", "ModelVersion", "ReplicaLost", "Ticket"]


class ModelVersion:
    def __init__(
        self,
        config: ModelConfig,
        version: int,
        version_dir: Path,
        metrics: Metrics | None = None,
        calls: Any = None,
    ):
        self.config = config
        # how this version's requests reach other models (an ensemble's steps, a python
        # model's BLS calls): the repository's `ModelCalls`; None outside a repository
        self.calls = calls
        self.version = version
        self.version_dir = version_dir
        self.state = "loading"
        self.error: str | None = None
        self.pending = 0  # started and not yet finished
        self.load_seconds = 0.0  # wall time of load(), warm-up included
        self.spans: list[tuple[coldstart.Span, coldstart.Span]] = []  # (load, warmup) each
        self._idle = asyncio.Event()
        self._idle.set()
        labels = (config.name, str(version))
        # label-bound metric children, resolved once: the request path only observes
        metrics = metrics or Metrics()
        self.m = _bind(metrics, labels)
        self.path: ExecutionPath = path_for(self)
        enabled = config.response_cache.enable
        self.cache = ResponseCache(config, version, metrics) if enabled else None

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.path.ready()

    def degraded(self) -> str | None:
        """Ray replicas being replaced while the others serve (None when all are up)."""
        return self.path.degraded() if self.state == "ready" else None

    @property
    def platform(self) -> str:
        return self.path.platform

    def problem(self) -> str | None:
        """Why liveness should fail for this version (None when healthy)."""
        return self.path.problem()

    def restarting(self) -> str | None:
        """What is being restarted ("restarting an instance", the engine), or None."""
        return self.path.restarting()

    # ------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Start the path (load and warm up), then take requests."""
        await asyncio.to_thread(preimport, {self.config.backend})
        started = time.perf_counter()
        try:
            self.spans, warmup = await self.path.load()
        except Exception as e:
            self.state = "failed"
            self.error = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
            raise LoadError(self.error) from e
        self.load_seconds = time.perf_counter() - started
        self.m["load"].set(self.load_seconds)
        self.m["warmup"].set(warmup)
        self.state = "ready"

    def describe(self) -> str:
        return self.path.describe()

    def begin(self) -> Lease:
        """A request starts (the drain waits for it) until the lease is released."""
        self.pending += 1
        self._idle.clear()
        return Lease(self)

    def end(self) -> None:
        self.pending -= 1
        if not self.pending:
            self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop taking requests and wait for the started ones; False on timeout."""
        if self.state == "ready":
            self.state = "draining"
        try:
            await asyncio.wait_for(self.idle(), timeout)
            return True
        except TimeoutError:
            return False

    async def idle(self) -> None:
        """Returns once no request holds a lease on this version (it keeps serving)."""
        await self._idle.wait()

    async def unload(self, timeout: float | None = 30.0) -> None:
        """Drain, then stop the path."""
        await self.drain(timeout)
        self.state = "unloaded"
        await self.path.stop()

    # ------------------------------------------------------------- requests

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        """Begin one inference on the path: queued for a batch, generated on the LLM
        engine, or denoised on the step loop. `background` (the shadow mirror): the
        lowest priority, no deadline of its own. Raises InvalidRequest or a full
        queue's error before anything is queued. With a response cache, a request seen
        before is answered from it without queueing (a hit takes no batch slot). With
        tracing on, the call is a span."""
        key = self.cache.key(request.inputs) if self.cache is not None else None
        if key is not None:
            assert self.cache is not None
            hit = self.cache.get(key)
            if hit is not None:
                answered = asyncio.get_running_loop().create_future()
                answered.set_result(hit)
                return Ticket(answered, lambda _: None)
        ticket = self.path.start(request, background)
        if key is not None:
            ticket.result.add_done_callback(functools.partial(_keep, self.cache, key))
        if tracing.enabled():
            tracing.model_call(self.config.name, self.version, ticket)
        return ticket

    async def infer(self, request: InferRequest, background: bool = False) -> dict:
        """`start` for a caller with no client to watch (the mirror, batch jobs)."""
        return await self.start(request, background).result

    def serves(self, task: str) -> bool:
        """Whether the version serves `task` ("infer", "generate", "embed", "images")."""
        return task in self.path.tasks

    def serving(self, task: str) -> Any:
        """The interface of `task`: "generate" the LLM front door (backends/llm.py),
        "embed" a batched path with its tokenizer, "images" the diffusion step loop.
        Raises NotSupported (400 naming the model) when the version does not serve it."""
        return self.path.serving(task)

    def report(self) -> Report:
        """Counters for statistics and metrics (a part the path has not is None)."""
        return self.path.report()

    # --------------------------------------------------------------- health

    def check(self) -> list[tuple[int, str]]:
        """(slot, why) for instances dead or wedged right now, not already restarting."""
        return self.path.check()

    async def restart(self, slot: int, reason: str) -> None:
        """Replace the instance in `slot`; the batch it held fails at once."""
        await self.path.restart(slot, reason)


class Lease:
    """One request's hold on its version; released once, even if the response that
    owned it never started streaming (then when it is garbage-collected)."""

    def __init__(self, version: ModelVersion):
        self.version: ModelVersion | None = version

    def release(self) -> None:
        if self.version is not None:
            self.version.end()
            self.version = None

    def __del__(self) -> None:
        self.release()


def _keep(cache: ResponseCache, key: bytes, result: asyncio.Future) -> None:
    """A cacheable request's answer, once it came back well, goes in the cache."""
    if not result.cancelled() and result.exception() is None:
        cache.put(key, result.result())


def _bind(metrics: Metrics, labels: tuple[str, str]) -> dict[str, Any]:
    """Label-bound children, resolved once: the request path only observes."""
    return {
        "batch": metrics.batch_size.labels(*labels),
        "queue": metrics.queue_duration.labels(*labels),
        "compute": metrics.compute_duration.labels(*labels),
        "load": metrics.load_seconds.labels(*labels),
        "warmup": metrics.warmup_seconds.labels(*labels),
        "inflight": metrics.inflight.labels(*labels),
        "duration": metrics.request_duration.labels(*labels),
        "success": metrics.success.labels(*labels),
    }
