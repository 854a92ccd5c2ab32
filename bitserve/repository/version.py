"""One served model version: its instances, its batcher, its health and its drain.

States: loading → ready → draining → unloaded, or loading → failed. A version is
`healthy` while every instance is alive and no batch has run past
`instance_group.execution_timeout_ms`; the watchdog restarts an instance that is not,
failing the batch it held so that no request hangs.

`start(request)` is the one request path below the protocols: a batched model (its
instances in threads, processes or Ray replicas), an LLM on its engine and a diffusion
model on its step loop alike take an `InferRequest` and give a `Ticket` whose result is
the outputs by name. HTTP, the
shadow mirror and batch jobs all come through here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bitserve import coldstart
from bitserve.backends import backend_class, is_llm, preimport
from bitserve.backends.base import LoadError
from bitserve.batching.batcher import DynamicBatcher, Request
from bitserve.batching.clock import LoopClock
from bitserve.config import ModelConfig
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.metrics import Metrics
from bitserve.repository.instance import Instance
from bitserve.repository.loading import device_for
from bitserve.repository.replica import ReplicaGone

if TYPE_CHECKING:
    from bitserve.backends.llm import LLMService
    from bitserve.diffusion.engine import DiffusionEngine

log = logging.getLogger("bitserve.repository")


class ExecutionError(Exception):
    """The model failed on a batch; every request in it gets this error (HTTP 500)."""


class ReplicaLost(Exception):
    """A Ray replica died while running the request's batch (HTTP 503, Retry-After)."""

    retry_after = 1


class ModelVersion:
    def __init__(
        self, config: ModelConfig, version: int, version_dir: Path, metrics: Metrics | None = None
    ):
        self.config = config
        self.version = version
        self.version_dir = version_dir
        self.state = "loading"
        self.error: str | None = None
        self.instances: list[Instance] = []
        self.unhealthy: set[int] = set()  # slots being restarted
        self.running: dict[int, tuple[int, list[Request]]] = {}  # slot -> (generation, batch)
        self.generation = 0
        self.batcher: DynamicBatcher | None = None
        self.llm: LLMService | None = None  # the engine, for backend "llm"
        self.pending = 0  # submitted and not yet finished
        self.restarts = {"wedged": 0, "died": 0}
        # Ray replicas: one dying leaves the version serving on the others.
        self.replicated = config.instance_group.isolation == "ray"
        self.retried = 0  # requests put back in the queue: their replica died first
        self.load_seconds = 0.0  # wall time of load(), warm-up included
        self.spans: list[tuple[coldstart.Span, coldstart.Span]] = []  # (load, warmup) each
        self._idle = asyncio.Event()
        self._idle.set()
        self._replacing: set[asyncio.Future] = set()
        labels = (config.name, str(version))
        # label-bound metric children, resolved once: the request path only observes
        self.m = _bind(metrics or Metrics(), labels)

    @property
    def ready(self) -> bool:
        if self.replicated:  # degraded but serving while one replica is healthy
            return self.state == "ready" and len(self.unhealthy) < len(self.instances)
        if self.llm is not None and self.llm.restarting is not None:
            return False
        return self.state == "ready" and not self.unhealthy

    def degraded(self) -> str | None:
        """Ray replicas being replaced while the others serve (None when all are up)."""
        if not (self.replicated and self.unhealthy and self.ready):
            return None
        healthy = len(self.instances) - len(self.unhealthy)
        return (
            f"{healthy} of {len(self.instances)} replicas healthy, "
            f"replacing {sorted(self.unhealthy)}"
        )

    @property
    def platform(self) -> str:
        if self.llm is not None:
            return "bitserve_llm"
        return self.instances[0].platform if self.instances else self.config.backend

    def problem(self) -> str | None:
        """Why liveness should fail for this version (None when healthy)."""
        if self.unhealthy and not self.replicated:  # a lost replica is not this process's
            return f"instance(s) {sorted(self.unhealthy)} restarting"
        if self.llm is not None and self.state in ("ready", "draining"):
            return self.llm.healthy()
        return None

    # ------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Start every instance (load and warm up), then open the queue."""
        await asyncio.to_thread(preimport, {self.config.backend})
        if is_llm(self.config.backend):
            return await self._load_llm()
        started = time.perf_counter()
        count = self.config.instance_group.count
        kind = self.config.instance_group.kind
        device = kind if self.replicated else device_for(kind)  # a replica resolves its own
        self.instances = [Instance(self.config, self.version_dir, i, device) for i in range(count)]
        results = await asyncio.gather(*(i.start() for i in self.instances), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.state = "failed"
            e = errors[0]
            self.error = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
            await asyncio.gather(*(i.stop() for i in self.instances), return_exceptions=True)
            raise LoadError(self.error) from e
        loop = asyncio.get_running_loop()
        # the backend's per-request check, resolved once (not an import lookup per request)
        self.validate = functools.partial(backend_class(self.config.backend).validate, self.config)
        self.batcher = DynamicBatcher(
            self.config.name,
            self.config.max_batch_size,
            self.config.dynamic_batching,
            count,
            self._execute,
            LoopClock(loop),
        )
        self.load_seconds = time.perf_counter() - started
        self.spans = [
            coldstart.spans(i.ready_at, i.load_only_seconds, i.warmup_seconds)
            for i in self.instances
        ]
        self.m["load"].set(self.load_seconds)
        self.m["warmup"].set(max(i.warmup_seconds for i in self.instances))
        self.state = "ready"

    async def _load_llm(self) -> None:
        from bitserve.backends.llm import LLMService

        started = time.perf_counter()
        try:
            service = LLMService(self.config, self.version_dir)
            await service.start()
        except Exception as e:
            self.state = "failed"
            self.error = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
            raise LoadError(self.error) from e
        self.llm = service
        self.load_seconds = time.perf_counter() - started
        warmup = service.warmup_seconds
        self.spans = [coldstart.spans(time.time(), self.load_seconds - warmup, warmup)]
        self.m["load"].set(self.load_seconds)
        self.m["warmup"].set(service.warmup_seconds)
        self.state = "ready"

    def begin(self) -> Lease:
        """An LLM request starts (the drain waits for it) until the lease is released."""
        self.pending += 1
        self._idle.clear()
        return Lease(self)

    def end(self) -> None:
        self.pending -= 1
        if not self.pending:
            self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop taking requests and wait for the submitted ones; False on timeout."""
        if self.state == "ready":
            self.state = "draining"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def unload(self, timeout: float | None = 30.0) -> None:
        """Drain, then release every instance."""
        await self.drain(timeout)
        self.state = "unloaded"
        await asyncio.gather(*(i.stop() for i in self.instances), return_exceptions=True)
        self.instances = []
        if self.llm is not None:
            await self.llm.stop()

    # ------------------------------------------------------------- requests

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        """Begin one inference: queued for a batch, or generated on the LLM engine.
        `background` (the shadow mirror): the lowest priority, no deadline of its own.
        Raises InvalidRequest or QueueFull before anything is queued."""
        if self.llm is not None:
            task = asyncio.ensure_future(self._generate(request))
            return Ticket(task, lambda _: task.cancel())
        if (engine := self.step_engine()) is not None:
            return self._diffuse(engine, request)
        job = self._job(request, background)
        future = self.submit(job)
        return Ticket(future, functools.partial(self._cancel_queued, job), job)

    async def infer(self, request: InferRequest, background: bool = False) -> dict:
        """`start` for a caller with no client to watch (the mirror, batch jobs)."""
        return await self.start(request, background).result

    def _job(self, request: InferRequest, background: bool) -> Request:
        policy = self.config.dynamic_batching
        levels = policy.priority_levels if policy else 1
        default = (policy.default_priority_level if policy else 0) or levels
        priority = levels if background else request.priority or default
        if priority > levels:
            raise InvalidRequest(f"parameter 'priority' {priority} exceeds {levels} levels")
        try:
            self.validate(request.inputs)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        now = asyncio.get_running_loop().time()
        timeout_s = 0.0 if background else _timeout(policy, request.timeout_us)
        return Request(
            request.inputs,
            request.rows,
            now,
            priority=priority,
            timeout_at=now + timeout_s if timeout_s else None,
            shape_key=request.shape_key,
        )

    def _cancel_queued(self, job: Request, error: BaseException) -> None:
        if job.state == "queued":  # a running batch cannot be taken back
            self.cancel(job, error)

    def step_engine(self) -> DiffusionEngine | None:
        """The diffusion step loop this version's in-process instances share, or None.
        Its rows are batched step by step there, so requests skip the dynamic batcher
        and a cancelled one leaves at the next step, running or not."""
        if self.config.backend != "diffusion":
            return None
        for instance in self.instances:
            if (engine := getattr(instance.model, "engine", None)) is not None:
                return engine
        return None

    def _diffuse(self, engine: DiffusionEngine, request: InferRequest) -> Ticket:
        from bitserve.backends.diffusion import request_params

        return self.diffuse(engine, request_params(self.config, request.inputs))  # 400s

    def diffuse(self, engine: DiffusionEngine, params: list) -> Ticket:
        """Images for `params` (GenerationParams) on the step loop; the result is
        {"image": uint8 [n, H, W]}. A cancel (or an error) takes every row out of the
        loop at its next step, running or queued. Raises Overloaded before anything
        stays queued."""
        import torch

        from bitserve.diffusion.sampler import to_uint8

        lease = self.begin()
        rows = []  # filled as submitted: an Overloaded midway still cancels the earlier ones
        try:
            for p in params:
                rows.append(engine.submit(p))
        except BaseException:
            for row in rows:
                engine.cancel(row)
            lease.release()
            raise

        async def images() -> dict:
            try:
                done = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in rows))
                return {"image": to_uint8(torch.stack(done))}
            finally:
                for row in rows:  # an error or a cancel: the rest leave at the next step
                    engine.cancel(row)
                lease.release()

        task = asyncio.ensure_future(images())
        return Ticket(task, lambda _: task.cancel())

    async def _generate(self, request: InferRequest) -> dict:
        assert self.llm is not None
        lease = self.begin()
        try:
            return await self.llm.infer(request.inputs)
        finally:
            lease.release()

    def submit(self, request: Request) -> asyncio.Future:
        """Queue a request; the future gets its outputs or its error, whatever happens.

        Raises QueueFull (nothing queued) when the batcher's queue is full."""
        assert self.batcher is not None
        future = asyncio.get_running_loop().create_future()

        def finished(outputs: Any, error: BaseException | None) -> None:
            self.end()
            if not future.done():
                future.set_exception(error) if error else future.set_result(outputs)

        request.on_done = finished
        self.pending += 1
        self._idle.clear()
        try:
            self.batcher.submit(request)
        except BaseException:
            self.end()
            raise
        return future

    def cancel(self, request: Request, error: BaseException) -> bool:
        """Take a request that has not started off the queue; it finishes with `error`."""
        assert self.batcher is not None
        if not self.batcher.cancel(request):
            return False
        request.finish(None, error)
        return True

    def _execute(self, slot: int, batch: list[Request]) -> None:
        if self.replicated and not self.instances[slot].alive():  # known dead: not sent
            return self._replica_gone(slot, batch, ReplicaGone("replica is dead", False))
        generation = self.generation = self.generation + 1
        self.running[slot] = (generation, batch)
        now = asyncio.get_running_loop().time()
        rows = sum(r.rows for r in batch)
        for request in batch:
            request.queue_seconds = now - request.arrival
            request.batch_rows = rows
            self.m["queue"].observe(request.queue_seconds)
        self.m["batch"].observe(rows)
        self.instances[slot].run(
            batch, lambda result, error: self._finish(slot, generation, result, error)
        )

    def _finish(self, slot: int, generation: int, result: Any, error: BaseException | None) -> None:
        current = self.running.get(slot)
        if current is None or current[0] != generation:
            return  # a restarted instance's late answer: its requests already failed
        del self.running[slot]
        batch = current[1]
        if self.replicated and isinstance(error, ReplicaGone):
            return self._replica_gone(slot, batch, error)
        if error is not None:
            if not isinstance(error, ExecutionError):
                log.error(
                    "model %s v%d failed on a batch: %s: %s",
                    self.config.name,
                    self.version,
                    type(error).__name__,
                    error,
                )
                error = ExecutionError(
                    f"model '{self.config.name}': {type(error).__name__}: {error}"
                )
            outputs: list[Any] = [None] * len(batch)
        else:
            outputs, seconds = result
            for request in batch:
                request.compute_seconds = seconds
            self.m["compute"].observe(seconds)
        for request, output in zip(batch, outputs, strict=True):
            request.finish(output, error)
        assert self.batcher is not None
        self.batcher.release(slot)

    def _replica_gone(self, slot: int, batch: list[Request], error: ReplicaGone) -> None:
        """A batch's replica died: retry the batch if it had not started, else fail it
        with 503; replace the replica (its slot stays out of the batcher meanwhile)."""
        assert self.batcher is not None
        log.error("model %s v%d replica %d: %s", self.config.name, self.version, slot, error)
        if error.started or self.state not in ("ready", "draining"):  # unloaded: no retry
            lost = ReplicaLost(f"model '{self.config.name}': {error}; retry the request")
            for request in batch:
                request.finish(None, lost)
        else:
            self.retried += len(batch)
            self.batcher.requeue(batch)
        if slot not in self.unhealthy and self.state in ("ready", "draining"):
            self.unhealthy.add(slot)  # before the watchdog looks again
            task = asyncio.ensure_future(self.restart(slot, "died"))
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)

    # --------------------------------------------------------------- health

    def check(self) -> list[tuple[int, str]]:
        """(slot, why) for instances dead or wedged right now, not already restarting."""
        limit = self.config.instance_group.execution_timeout_ms / 1000.0
        bad = []
        for instance in self.instances:
            if instance.slot in self.unhealthy:
                continue
            busy = instance.busy_for()
            if not instance.alive():
                bad.append((instance.slot, "died"))
            elif limit > 0 and busy > limit:
                bad.append((instance.slot, f"wedged (a batch ran {busy:.1f} s)"))
        return bad

    async def restart(self, slot: int, reason: str) -> None:
        """Replace the instance in `slot`; the batch it held fails at once."""
        assert self.batcher is not None
        log.error(
            "model %s v%d instance %d %s: restarting", self.config.name, self.version, slot, reason
        )
        self.unhealthy.add(slot)
        self.restarts["died" if reason == "died" else "wedged"] += 1
        old = self.instances[slot]
        old.kill()
        if slot in self.batcher.free:
            self.batcher.free.remove(slot)
        if not self.replicated:
            error = ExecutionError(f"model '{self.config.name}': instance {reason}; restarted")
            self._fail_held(slot, error)
        # A replica's batch is settled by its own call, which the kill ends: retried if
        # it had not started there, else failed with 503.
        while self.state in ("ready", "draining"):
            fresh = Instance(self.config, self.version_dir, slot, old.device)
            try:
                await fresh.start()
            except Exception as e:
                log.error("restarting %s instance %d failed: %s", self.config.name, slot, e)
                await asyncio.sleep(1.0)
                continue
            if self.state not in ("ready", "draining"):  # unloaded while it started
                await fresh.stop()
                return
            self.instances[slot] = fresh
            lost = ReplicaLost(f"model '{self.config.name}': replica {reason}; retry the request")
            self._fail_held(slot, lost)
            self.unhealthy.discard(slot)
            self.batcher.release(slot)
            log.info("model %s v%d instance %d restarted", self.config.name, self.version, slot)
            return

    def _fail_held(self, slot: int, error: BaseException) -> None:
        """The batch `slot` still holds, if any (its call never returned), fails with `error`."""
        held = self.running.pop(slot, None)
        if held is not None:
            for request in held[1]:
                request.finish(None, error)


@dataclass
class Ticket:
    """A started inference: `result` resolves to the outputs by name (or raises);
    `cancel(error)` takes it back if it has not started running (a client that left);
    `job` is the batcher's request, for the access log (None for an LLM)."""

    result: asyncio.Future
    cancel: Any
    job: Request | None = None


def _timeout(policy: Any, timeout_us: int) -> float:
    """Seconds: the config's default, or the request's if allowed and shorter."""
    default = (policy.default_timeout_ms / 1000.0) if policy else 0.0
    asked = timeout_us / 1e6
    if asked and (policy is None or policy.allow_timeout_override):
        return min(asked, default) if default else asked
    return default


class Lease:
    """One LLM request's hold on its version; released once, even if the response
    that owned it never started streaming (then when it is garbage-collected)."""

    def __init__(self, version: ModelVersion):
        self.version: ModelVersion | None = version

    def release(self) -> None:
        if self.version is not None:
            self.version.end()
            self.version = None

    def __del__(self) -> None:
        self.release()


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
