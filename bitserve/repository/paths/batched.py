"""Batched models: instances (threads, processes or Ray replicas) fed by the dynamic
batcher.

A request is validated by its backend, queued at its priority with its timeout, and
runs in a batch on a free instance; its result is its rows of the batch's outputs. An
instance dead or wedged past `instance_group.execution_timeout_ms` is restarted by the
watchdog (`check`, `restart`), failing the batch it held so that no request hangs. A
Ray replica that dies leaves the version serving on the others: a batch it had not
started runs elsewhere, one it was running fails with 503 (ReplicaLost).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from bitserve import coldstart
from bitserve.backends import backend_class
from bitserve.batching.batcher import DynamicBatcher, Request
from bitserve.batching.clock import LoopClock
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.repository.instance import Instance, InstanceDied
from bitserve.repository.loading import device_for
from bitserve.repository.paths.base import ExecutionPath, Report, Ticket
from bitserve.repository.replica import Autoscaler, ReplicaGone

log = logging.getLogger("bitserve.repository")


class ExecutionError(Exception):
    """The model failed on a batch; every request in it gets this error (HTTP 500)."""


class ReplicaLost(Exception):
    """A Ray replica, or a process-isolated instance, died while running the request's
    batch (HTTP 503, Retry-After): the caller did nothing wrong and a retry will be
    served, by another replica or the restarted instance."""

    retry_after = 1


class BatchedPath(ExecutionPath):
    def __init__(self, version: Any):
        super().__init__(version)
        config = self.config
        self.instances: list[Instance] = []
        self.unhealthy: set[int] = set()  # slots being restarted
        self.running: dict[int, tuple[int, list[Request]]] = {}  # slot -> (generation, batch)
        self.generation = 0
        self.batcher: DynamicBatcher | None = None
        self.restarts = {"wedged": 0, "died": 0}
        # Ray replicas: one dying leaves the version serving on the others.
        self.replicated = config.instance_group.isolation == "ray"
        self.retried = 0  # requests put back in the queue: their replica died first
        self._replacing: set[asyncio.Future] = set()
        # autoscaling (Ray replicas): slots scaled down, being drained, being started
        self.scaler: Autoscaler | None = None
        self.retired: set[int] = set()
        self.retiring: set[int] = set()
        self.starting: set[int] = set()
        self._scaling_tasks: set[asyncio.Future] = set()

    @property
    def platform(self) -> str:  # type: ignore[override]
        return self.instances[0].platform if self.instances else self.config.backend

    # ------------------------------------------------------------ lifecycle

    async def load(self) -> tuple[list[tuple[coldstart.Span, coldstart.Span]], float]:
        """Start every instance (load and warm up), then open the queue."""
        config, version = self.config, self.version
        count = config.instance_group.count
        scaling = config.instance_group.autoscaling
        if scaling is not None:  # count is the initial number, at least one to start
            count = min(max(count, scaling.min_replicas, 1), scaling.max_replicas)
        kind = config.instance_group.kind
        device = kind if self.replicated else device_for(kind)  # a replica resolves its own
        self.instances = [
            Instance(config, version.version_dir, i, device, version.calls) for i in range(count)
        ]
        results = await asyncio.gather(*(i.start() for i in self.instances), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(i.stop() for i in self.instances), return_exceptions=True)
            raise errors[0]
        loop = asyncio.get_running_loop()
        # the backend's per-request check, resolved once (not an import lookup per request)
        self.validate = functools.partial(backend_class(config.backend).validate, config)
        self.batcher = DynamicBatcher(
            config.name,
            config.max_batch_size,
            config.dynamic_batching,
            count,
            self._execute,
            LoopClock(loop),
        )
        if scaling is not None:
            self.scaler = Autoscaler(self, scaling)
            self.scaler.start()
        spans = [
            coldstart.spans(i.ready_at, i.load_only_seconds, i.warmup_seconds)
            for i in self.instances
        ]
        return spans, max(i.warmup_seconds for i in self.instances)

    async def stop(self) -> None:
        if self.scaler is not None:
            await self.scaler.stop()
        for task in list(self._scaling_tasks):
            task.cancel()
        await asyncio.gather(*(i.stop() for i in self.instances), return_exceptions=True)
        self.instances = []

    def ready(self) -> bool:
        if self.replicated:  # degraded but serving while one replica is healthy
            serving = self.serving_slots()
            if not serving and self.scaler is not None:
                return True  # scaled to zero: the next request starts one
            return len(self.unhealthy) < len(serving)
        return not self.unhealthy

    def degraded(self) -> str | None:
        """Ray replicas being replaced while the others serve (None when all are up)."""
        if not (self.replicated and self.unhealthy and self.ready()):
            return None
        serving = len(self.serving_slots())
        healthy = serving - len(self.unhealthy)
        return f"{healthy} of {serving} replicas healthy, replacing {sorted(self.unhealthy)}"

    def problem(self) -> str | None:
        if self.unhealthy and not self.replicated:  # a lost replica is not this process's
            return f"instance(s) {sorted(self.unhealthy)} restarting"
        return None

    def restarting(self) -> str | None:
        return "restarting an instance" if self.unhealthy else None

    def report(self) -> Report:
        if self.batcher is None:
            return Report()
        healthy = len(self.serving_slots()) - len(self.unhealthy)
        return Report(
            batch=self.batcher.stats,
            queued=self.batcher.queued,
            healthy=healthy,
            restarts=dict(self.restarts),
            retried=self.retried,
        )

    def describe(self) -> str:
        warmups = sum(w.count for w in self.config.model_warmup)
        return f"{len(self.instances)} instance(s), {warmups} warmup request(s)"

    def serving(self, task: str) -> Any:
        if task in ("embed", "score") and task in self.tasks and self.instances:
            return self
        return super().serving(task)

    def token_counter(self) -> Callable[[list[str]], int] | None:
        """The model's token count of texts, when it has one (embedding usage)."""
        return getattr(self.instances[0].model, "count_tokens", None) if self.instances else None

    def pair_counter(self) -> Callable[[list[str], list[str]], tuple[list[int], int]] | None:
        """The model's token count of each (query, document) pair and its max_length,
        when it has them in this process (rerank and score usage and length limits)."""
        return getattr(self.instances[0].model, "count_pairs", None) if self.instances else None

    # ------------------------------------------------------------- requests

    def start(self, request: InferRequest, background: bool = False) -> Ticket:
        job = self._job(request, background)
        future = self.submit(job)
        return Ticket(future, functools.partial(self._cancel_queued, job), job)

    def _job(self, request: InferRequest, background: bool) -> Request:
        policy = self.config.dynamic_batching
        levels = policy.priority_levels if policy else 1
        default = (policy.default_priority_level if policy else 0) or levels
        priority = levels if background else request.priority or default
        if priority > levels:
            raise InvalidRequest(f"parameter 'priority' {priority} exceeds {levels} levels")
        try:
            self.validate(request.inputs)
        except ValueError as e:  # the backend's documented way to refuse (base.validate)
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

    def submit(self, request: Request) -> asyncio.Future:
        """Queue a request; the future gets its outputs or its error, whatever happens.

        Raises QueueFull (nothing queued) when the batcher's queue is full."""
        assert self.batcher is not None
        future = asyncio.get_running_loop().create_future()
        lease = self.version.begin()

        def finished(outputs: Any, error: BaseException | None) -> None:
            lease.release()
            if not future.done():
                future.set_exception(error) if error else future.set_result(outputs)

        request.on_done = finished
        try:
            self.batcher.submit(request)
        except BaseException:
            lease.release()
            raise
        if self.scaler is not None and not self.serving_slots():
            self.scaler.tick()  # scaled to zero: start one now, not at the next tick
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
        m = self.version.m
        for request in batch:
            request.queue_seconds = now - request.arrival
            request.batch_rows = rows
            m["queue"].observe(request.queue_seconds)
        m["batch"].observe(rows)
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
        if isinstance(error, InstanceDied):  # it is being restarted: come back
            log.error(
                "model %s v%d instance %d: %s", self.config.name, self.version.version, slot, error
            )
            error = ReplicaLost(f"model '{self.config.name}': {error}; retry the request")
        if error is not None:
            if not isinstance(error, (ExecutionError, ReplicaLost)):
                log.error(
                    "model %s v%d failed on a batch: %s: %s",
                    self.config.name,
                    self.version.version,
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
            self.version.m["compute"].observe(seconds)
        for request, output in zip(batch, outputs, strict=True):
            if isinstance(output, Exception):  # one request's own failure (collate.run)
                request.finish(None, self._own_error(output))
            else:
                request.finish(output, error)
        self._release(slot)

    def _release(self, slot: int) -> None:
        """The slot's batch is done: it takes the next one, or, scaled down, it goes."""
        assert self.batcher is not None
        if slot in self.retiring:
            self._spawn_task(self._unload(slot))
        else:
            self.batcher.release(slot)

    # ------------------------------------------------------------ autoscaling

    def serving_slots(self) -> list[int]:
        """The slots that take batches (or will, once restarted): not scaled down and
        not still starting."""
        gone = self.retired | self.retiring | self.starting
        return [i.slot for i in self.instances if i.slot not in gone]

    def grow(self) -> None:
        """Start one more replica, in a slot scaled down before or a new one."""
        version = self.version
        slot = min(self.retired) if self.retired else len(self.instances)
        kind = self.config.instance_group.kind
        fresh = Instance(self.config, version.version_dir, slot, kind, version.calls)
        if slot < len(self.instances):
            self.instances[slot] = fresh
            self.retired.discard(slot)
        else:
            self.instances.append(fresh)
        self.starting.add(slot)
        log.info("model %s: scaling up, starting replica %d", self.config.name, slot)
        self._spawn_task(self._grow(fresh))

    async def _grow(self, fresh: Instance) -> None:
        slot = fresh.slot
        try:
            await fresh.start()
        except Exception as e:
            log.error("model %s: scaling up replica %d: %s", self.config.name, slot, e)
            self.retired.add(slot)
            return
        finally:
            self.starting.discard(slot)
        if not self._serving():
            await fresh.stop()
            return
        assert self.batcher is not None
        self.batcher.release(slot)

    def retire(self, slot: int) -> None:
        """Scale down: the slot takes no new batch; once the one it holds (if any) is
        done, its replica is unloaded."""
        assert self.batcher is not None
        log.info("model %s: scaling down, draining replica %d", self.config.name, slot)
        self.retiring.add(slot)
        if slot in self.batcher.free:  # idle: nothing to wait for
            self.batcher.free.remove(slot)
            self._spawn_task(self._unload(slot))

    async def _unload(self, slot: int) -> None:
        try:
            await self.instances[slot].stop()
        except Exception as e:
            log.warning("model %s: replica %d unloaded badly: %s", self.config.name, slot, e)
            self.instances[slot].kill()
        finally:
            self.retiring.discard(slot)
            self.retired.add(slot)

    def _spawn_task(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._scaling_tasks.add(task)
        task.add_done_callback(self._scaling_tasks.discard)

    def _own_error(self, error: Exception) -> Exception:
        """A per-request model's answer for one request that it refused: a ValueError is
        the caller's mistake (400, as `validate`'s), anything else the model's (500)."""
        message = f"model '{self.config.name}': {error}"
        if isinstance(error, ValueError):
            return InvalidRequest(message)
        return ExecutionError(f"model '{self.config.name}': {type(error).__name__}: {error}")

    def _serving(self) -> bool:
        return self.version.state in ("ready", "draining")

    def _replica_gone(self, slot: int, batch: list[Request], error: ReplicaGone) -> None:
        """A batch's replica died: retry the batch if it had not started, else fail it
        with 503; replace the replica (its slot stays out of the batcher meanwhile)."""
        assert self.batcher is not None
        version = self.version
        log.error("model %s v%d replica %d: %s", self.config.name, version.version, slot, error)
        if error.started or not self._serving():  # unloaded: no retry
            lost = ReplicaLost(f"model '{self.config.name}': {error}; retry the request")
            for request in batch:
                request.finish(None, lost)
        else:
            self.retried += len(batch)
            self.batcher.requeue(batch)
        if slot in self.retiring:  # it was being scaled down: nothing to replace
            self.retiring.discard(slot)
            self.retired.add(slot)
            self.instances[slot].kill()
        elif slot not in self.unhealthy and self._serving():
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
            if instance.slot in self.unhealthy | self.retired | self.retiring | self.starting:
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
        name, number = self.config.name, self.version.version
        log.error("model %s v%d instance %d %s: restarting", name, number, slot, reason)
        self.unhealthy.add(slot)
        self.restarts["died" if reason == "died" else "wedged"] += 1
        old = self.instances[slot]
        old.kill()
        if slot in self.batcher.free:
            self.batcher.free.remove(slot)
        if not self.replicated:
            lost = f"model '{name}': instance {reason}; restarted"
            self._fail_held(slot, ReplicaLost(lost) if reason == "died" else ExecutionError(lost))
        # A replica's batch is settled by its own call, which the kill ends: retried if
        # it had not started there, else failed with 503.
        while self._serving():
            version = self.version
            fresh = Instance(self.config, version.version_dir, slot, old.device, version.calls)
            try:
                await fresh.start()
            except Exception as e:
                log.error("restarting %s instance %d failed: %s", name, slot, e)
                await asyncio.sleep(1.0)
                continue
            if not self._serving():  # unloaded while it started
                await fresh.stop()
                return
            self.instances[slot] = fresh
            lost = ReplicaLost(f"model '{name}': replica {reason}; retry the request")
            self._fail_held(slot, lost)
            self.unhealthy.discard(slot)
            self.batcher.release(slot)
            log.info("model %s v%d instance %d restarted", name, number, slot)
            return

    def _fail_held(self, slot: int, error: BaseException) -> None:
        """The batch `slot` still holds, if any (its call never returned), fails with `error`."""
        held = self.running.pop(slot, None)
        if held is not None:
            for request in held[1]:
                request.finish(None, error)


def _timeout(policy: Any, timeout_us: int) -> float:
    """Seconds: the config's default, or the request's if allowed and shorter."""
    default = (policy.default_timeout_ms / 1000.0) if policy else 0.0
    asked = timeout_us / 1e6
    if asked and (policy is None or policy.allow_timeout_override):
        return min(asked, default) if default else asked
    return default
