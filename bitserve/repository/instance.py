"""One instance of a model version: a model, the thread that runs it, and its health.

Each instance owns one worker thread. The event loop only queues and routes; merging a
batch, running the model and slicing the outputs happen on that thread (torch,
onnxruntime and numpy release the GIL there), so a slow batch never stalls HTTP.

With `instance_group.isolation = "process"` the model itself lives in a child process
(as Triton runs Python models) and the thread forwards each merged batch over a pipe: a
model that crashes or is killed takes down only its child, and a wedged one can really
be killed. The thread mode is the default because it copies nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bitserve.backends import Model
from bitserve.backends.base import LoadError
from bitserve.backends.bls import Models
from bitserve.batching.batcher import Request
from bitserve.batching.collate import run
from bitserve.config import ModelConfig
from bitserve.repository.loading import build_model
from bitserve.tensors import coerce

log = logging.getLogger("bitserve.repository")

Done = Callable[[Any, BaseException | None], None]


class InstanceDied(RuntimeError):
    """The instance's process exited while it held a batch."""


class Worker:
    """A thread fed through a SimpleQueue; results return to the event loop with one
    `call_soon_threadsafe` (cheaper than `run_in_executor`'s two futures per call).
    `busy_since` tells the watchdog how long the current job has run."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_since: float | None = None
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, args: tuple, done: Done) -> None:
        """Run fn(*args) on the thread; call done(result, error) on the loop."""
        self.jobs.put((fn, args, done))

    def call(self, fn: Callable, *args: Any) -> asyncio.Future:
        future = self.loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error else future.set_result(result)

        self.submit(fn, args, done)
        return future

    def stop(self) -> None:
        self.jobs.put(None)

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, done = job
            self.busy_since = time.monotonic()
            try:
                result, error = fn(*args), None
            except BaseException as e:  # delivered to the caller, never lost
                result, error = None, e
            self.busy_since = None
            try:
                self.loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop closed during shutdown
                return


class Instance:
    """Slot `slot` of a model version. `start` loads it; `run` executes one batch."""

    def __init__(
        self, config: ModelConfig, version_dir: Path, slot: int, device: str, calls: Any = None
    ):
        self.config = config
        self.calls = calls  # the repository's ModelCalls: a python model's BLS handle
        self.version_dir = version_dir
        self.slot = slot
        self.device = device
        self.model: Model | RemoteModel | None = None
        self.worker: Worker | None = None
        self.platform = config.backend
        self.warmup_seconds = 0.0
        self.load_only_seconds = 0.0
        self.ready_at = 0.0  # wall clock (time.time) when loaded and warm

    async def start(self) -> None:
        name = f"{self.config.name}-{self.version_dir.name}-{self.slot}"
        self.worker = Worker(name, asyncio.get_running_loop())
        try:
            self.model = await self.worker.call(self._build)
        except BaseException:
            self.worker.stop()
            raise
        self.platform = self.model.platform
        self.warmup_seconds = self.model.warmup_seconds
        self.load_only_seconds = self.model.load_only_seconds
        self.ready_at = time.time()

    def _build(self) -> Model | RemoteModel:
        if self.config.instance_group.isolation == "ray":
            from bitserve.repository.replica import RayModel

            return RayModel.spawn(self.config, self.version_dir, self.device, self.slot)
        if self.config.instance_group.isolation == "process":
            return RemoteModel.spawn(self.config, self.version_dir, self.device)
        models = None
        if self.calls is not None and self.config.backend == "python":
            assert self.worker is not None
            models = Models(self.calls, self.worker.loop)
        return build_model(self.config, self.version_dir, self.device, models)

    def run(self, batch: list[Request], done: Done) -> None:
        """merge → predict → split on the worker; done(per-request outputs, error)."""
        assert self.worker is not None
        self.worker.submit(self._execute, (batch,), done)

    def _execute(self, batch: list[Request]) -> tuple[list[dict], float]:
        assert self.model is not None
        started = time.perf_counter()
        return run(self.config, self.model, batch), time.perf_counter() - started

    def busy_for(self) -> float:
        """Seconds the current batch has been running (0 when idle)."""
        since = self.worker.busy_since if self.worker else None
        return 0.0 if since is None else time.monotonic() - since

    def alive(self) -> bool:
        if self.worker is None or not self.worker.thread.is_alive():
            return False
        alive = getattr(self.model, "alive", None)  # a child process or a Ray replica
        return alive is None or alive()

    async def stop(self) -> None:
        """Unload gracefully on the worker, then end the thread."""
        if self.worker is None:
            return
        if self.model is not None and self.alive():
            await self.worker.call(self.model.unload)
        self.worker.stop()

    def kill(self) -> None:
        """Give up on this instance now. A child process is killed; a wedged thread
        cannot be, so it is abandoned (it is a daemon) and its late result is ignored."""
        if hasattr(self.model, "kill"):  # a child process or a Ray replica
            self.model.kill()
        if self.worker is not None:
            self.worker.stop()


class RemoteModel:
    """A backend model in a child process, driven over a pipe with `predict`."""

    platform = "unknown"

    def __init__(self, process: Any, conn: Any, ready: dict):
        self.process, self.conn = process, conn
        self.platform, self.warmup_seconds = ready["platform"], ready["warmup_seconds"]
        self.load_only_seconds = ready["load_seconds"]

    @classmethod
    def spawn(cls, config: ModelConfig, version_dir: Path, device: str) -> RemoteModel:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(
            target=_child_main,
            args=(config.model_dump(mode="json"), str(version_dir), device, child_conn),
            name=f"bitserve-{config.name}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        try:
            status, detail = conn.recv()
        except EOFError:
            process.join(1)
            raise LoadError(
                f"{version_dir}: instance process exited while loading "
                f"(exit code {process.exitcode})"
            ) from None
        if status != "ready":
            process.join(1)
            raise LoadError(detail)
        return cls(process, conn, detail)

    def predict(self, inputs: dict) -> dict:
        try:
            self.conn.send(inputs)
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise InstanceDied(
                f"instance process died (exit code {self.process.exitcode})"
            ) from None
        if status != "ok":
            raise RuntimeError(payload)
        return payload

    def alive(self) -> bool:
        return self.process.is_alive()

    def unload(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()

    def kill(self) -> None:
        self.process.kill()


def _child_main(config_doc: dict, version_dir: str, device: str, conn: Any) -> None:
    """The child process: build the model, then answer batches until told to stop."""
    config = ModelConfig.model_validate(config_doc)
    try:
        model = build_model(config, Path(version_dir), device)
    except Exception as e:
        conn.send(("failed", str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"))
        return
    conn.send(
        (
            "ready",
            {
                "platform": model.platform,
                "warmup_seconds": model.warmup_seconds,
                "load_seconds": model.load_only_seconds,
            },
        )
    )
    declared = {spec.name: spec.datatype for spec in config.output}
    while True:
        try:
            inputs = conn.recv()
        except EOFError:
            return
        if inputs is None:
            model.unload()
            return
        try:
            outputs = model.predict(inputs)
            reply = {k: coerce(v, declared[k]) for k, v in outputs.items() if k in declared}
            conn.send(("ok", reply))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
