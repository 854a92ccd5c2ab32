"""Data-parallel replicas on Ray: each instance of a model version is a Ray actor.

With `instance_group.isolation = "ray"` every one of the group's `count` instances is
a `ReplicaActor` placed by Ray with its own resources (`num_cpus`, `num_gpus`), on any
machine of the cluster, running the same backend code as an in-process instance. The
server stays the router: its dynamic batcher forms each batch and sends it to one idle
replica, so batching still happens in front of the replicas. A replica loads the version
folder from its own node's disk, at the same path: every node needs bitserve and the
repository (the same image, or a shared volume).

Routing is least outstanding requests. A replica runs one batch at a time and the
batcher dispatches only to an idle one, so every replica that gets a batch has zero
outstanding; when none is idle the batch waits in the router's queue. (Ray Serve's
power-of-two choices approximates this for routers that cannot see every replica's
queue; this router owns the queue and sees them all.)

A replica that dies is noticed by the batch it held or, when idle, by a ping every
second; it is replaced by a new actor (`ModelVersion.restart`). What happens to the
requests:

- queued in the router: never sent, they go to the healthy replicas;
- sent to the dead replica but not started there (the actor answers every batch first
  with a start mark, so the router knows): put back at the head of the queue and run on
  another replica: nothing is lost;
- running on the replica when it died: fail with 503 and Retry-After. Inference is
  idempotent, so the client may retry; the server does not, because a batch that
  crashed one replica (out of memory, a poison input) would crash the next.

The model stays ready while at least one replica is healthy (as Ray Serve keeps
serving); readiness says which replicas are being replaced, and the version is not
ready only when none is healthy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from bitserve import raycluster
from bitserve.backends.base import LoadError
from bitserve.config import ModelConfig
from bitserve.repository.scaling import ScalingRule

log = logging.getLogger("bitserve.repository")

PING_PERIOD_S = 1.0
START_TIMEOUT_S = 300.0  # a replica Ray cannot place or load in this time fails the load
STARTED = "started"


class ReplicaGone(RuntimeError):
    """The replica's actor died while it held a batch; `started` tells whether the
    batch had begun running there (then its requests fail) or not (they are retried)."""

    def __init__(self, message: str, started: bool):
        super().__init__(message)
        self.started = started


class ReplicaActor:
    """The actor: one model instance, built with the same code as an in-process one."""

    def __init__(self, config_doc: dict, version_dir: str, kind: str, threads: int):
        from bitserve.repository.loading import build_model, device_for

        config = ModelConfig.model_validate(config_doc)
        if threads > 0 and config.backend in ("torch", "hf", "llm"):
            import torch

            torch.set_num_threads(threads)
        self.model = build_model(config, Path(version_dir), device_for(kind))
        self.declared = {spec.name: spec.datatype for spec in config.output}

    def info(self) -> dict:
        return {
            "platform": self.model.platform,
            "warmup_seconds": self.model.warmup_seconds,
            "load_seconds": self.model.load_only_seconds,
            "pid": os.getpid(),
        }

    def predict(self, inputs: dict):
        """A generator: the start mark, then the outputs (so the router knows which)."""
        from bitserve.tensors import coerce

        yield STARTED
        outputs = self.model.predict(inputs)
        yield {k: coerce(v, self.declared[k]) for k, v in outputs.items() if k in self.declared}

    def ping(self) -> bool:
        return True

    def unload(self) -> None:
        self.model.unload()


class RayModel:
    """The router's handle on one replica; `predict` blocks its instance's worker thread."""

    platform = "unknown"

    def __init__(self, actor: Any, info: dict):
        self.actor = actor
        self.platform = info["platform"]
        self.warmup_seconds = info["warmup_seconds"]
        self.load_only_seconds = info["load_seconds"]
        self.pid = info["pid"]
        self.dead: str | None = None  # why, once the actor is known to be gone
        self._ping: Any = None
        self._last_ping = time.monotonic()

    @classmethod
    def spawn(cls, config: ModelConfig, version_dir: Path, kind: str, slot: int) -> RayModel:
        """Create the actor and wait until its model is loaded and warmed."""
        raycluster.connect()
        import ray

        group = config.instance_group
        resources = group.ray_resources()
        _check_feasible(ray, config.name, resources)
        threads = group.threads or max(1, int(resources["num_cpus"]))
        actor = (
            ray.remote(ReplicaActor)
            .options(
                **resources,
                max_restarts=0,  # the router replaces a dead replica with a fresh actor
                max_concurrency=2,  # a ping is answered while a batch runs
                name=f"bitserve:{config.name}:{version_dir.name}:{slot}:{os.getpid()}:"
                f"{time.monotonic_ns()}",
            )
            .remote(config.model_dump(mode="json"), str(version_dir), kind, threads)
        )
        try:
            info = ray.get(actor.info.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise LoadError(
                f"{version_dir}: Ray replica {slot} not placed and loaded in "
                f"{START_TIMEOUT_S:.0f} s (resources {resources})"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise LoadError(f"{version_dir}: Ray replica {slot} failed to load: {_cause(e)}") from e
        log.info("model %s replica %d up: Ray actor pid %d", config.name, slot, info["pid"])
        return cls(actor, info)

    def predict(self, inputs: dict) -> dict:
        import ray

        stream = self.actor.predict.options(num_returns="streaming").remote(inputs)
        started = False
        try:
            ray.get(next(stream))
            started = True
            return ray.get(next(stream))
        except ray.exceptions.RayActorError as e:
            self.dead = "died"
            where = "while running the batch" if started else "before the batch started"
            raise ReplicaGone(f"replica (pid {self.pid}) died {where}", started) from e
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(_cause(e)) from None

    def alive(self) -> bool:
        """Non-blocking: what the last ping said; sends the next one when it is due."""
        if self.dead:
            return False
        if self._ping is None and time.monotonic() - self._last_ping >= PING_PERIOD_S:
            # No lock here: a ping already answered runs its callback right inside
            # add_done_callback, on this thread.
            self._ping = self.actor.ping.remote().future()
            self._ping.add_done_callback(self._pinged)
        return not self.dead

    def _pinged(self, future: Any) -> None:
        """On Ray's thread (or inside add_done_callback): record the answer."""
        if future.exception() is not None:
            self.dead = self.dead or "died"
        self._last_ping = time.monotonic()
        self._ping = None

    def unload(self) -> None:
        import ray

        try:
            ray.get(self.actor.unload.remote(), timeout=10)
        except Exception as e:  # dead or wedged: it is killed below either way
            log.warning("replica (pid %d) did not unload cleanly: %s", self.pid, e)
        self.kill()

    def kill(self) -> None:
        import ray

        self.dead = self.dead or "killed"
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actor, no_restart=True)


def _check_feasible(ray: Any, name: str, resources: dict[str, float]) -> None:
    """A replica no node can hold: refused at once on a `local` Ray (it would wait for
    ever); on a cluster only logged, since an autoscaler (KubeRay's) may add the node."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = any(
        node.get("CPU", 0) >= resources["num_cpus"] and node.get("GPU", 0) >= resources["num_gpus"]
        for node in nodes
    )
    if fits:
        return
    problem = (
        f"model '{name}': no Ray node has {resources['num_cpus']:g} CPU and "
        f"{resources['num_gpus']:g} GPU for a replica"
    )
    if raycluster.address() == "local":
        raise LoadError(problem)
    log.warning(
        "%s; waiting up to %.0f s for one (an autoscaler may add it)", problem, START_TIMEOUT_S
    )


def _cause(error: BaseException) -> str:
    """The model's own error out of Ray's wrapper."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# ---------------------------------------------------------------- autoscaling

SCALE_TICK_S = 0.25


class Autoscaler:
    """A batched model's Ray replicas scaled on load, by the rule the LLM replicas use
    (Ray Serve's): ongoing requests (queued in the router plus those in the batches the
    replicas are running) over `target_ongoing_requests` per replica, clamped to
    [min_replicas, max_replicas]; a change wanted for `upscale_delay_s` (more) or
    `downscale_delay_s` (fewer) is made. A replica scaled down first takes no new batch,
    finishes the one it holds, then is unloaded: no request is cut. At zero replicas
    (min_replicas = 0) a request waits in the queue while one starts (--lazy-load's cold
    start): from zero the delay is not waited."""

    def __init__(self, path: Any, scaling: Any):
        self.path, self.rule = path, ScalingRule(scaling)
        self._task: Any = None

    def start(self) -> None:
        import asyncio

        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        import asyncio

        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(SCALE_TICK_S)
            try:
                self.tick()
            except Exception:  # never let one bad tick end the scaling
                log.exception("model %s: autoscaling", self.path.config.name)

    def ongoing(self) -> int:
        path = self.path
        queued = path.batcher.queued if path.batcher is not None else 0
        return queued + sum(len(batch) for _, batch in path.running.values())

    def tick(self) -> None:
        path = self.path
        if not path._serving():
            return
        have = len(path.serving_slots()) + len(path.starting)
        change = self.rule.change(self.ongoing(), have)
        for _ in range(max(change, 0)):
            path.grow()
        if change < 0:  # one at a time, an idle one first
            slots = path.serving_slots()
            idle = [s for s in slots if s not in path.running]
            path.retire((idle or slots)[-1])
