"""One served model version: its instances, their worker threads, and its batcher.

Each instance is a backend `Model` with one worker thread of its own. The event loop
only queues and routes; merging the batch, running the model and slicing the outputs
happen on the instance's thread (torch, onnxruntime and numpy release the GIL there),
so a slow batch never stalls the HTTP side.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.backends import Model, backend_class
from bitserve.backends.base import LoadError
from bitserve.batching.batcher import DynamicBatcher, Request
from bitserve.batching.clock import LoopClock
from bitserve.batching.collate import dummy_inputs, merge, split
from bitserve.repository.config import ModelConfig

log = logging.getLogger("bitserve.repository")


class ExecutionError(Exception):
    """The model raised while running a batch; every request in it gets this error."""


class Worker:
    """One instance's thread. Jobs go in through a SimpleQueue and results come back to
    the event loop with one `call_soon_threadsafe`: the cheapest hop there is, cheaper
    than `run_in_executor`'s two futures per call."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable, args: tuple, done: Callable[[Any, BaseException | None], None]):
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
            try:
                result, error = fn(*args), None
            except BaseException as e:  # delivered to the caller, never lost
                result, error = None, e
            try:
                self.loop.call_soon_threadsafe(done, result, error)
            except RuntimeError:  # the loop closed during shutdown
                return


class ModelVersion:
    def __init__(self, config: ModelConfig, version: int, version_dir: Path):
        self.config = config
        self.version = version
        self.version_dir = version_dir
        self.state = "loading"  # loading -> ready | failed -> unloaded
        self.error: str | None = None
        self.instances: list[Model] = []
        self.workers: list[Worker] = []
        self.batcher: DynamicBatcher | None = None
        self.load_seconds = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    # ------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Build every instance on its own thread, warm it up, then open the queue."""
        self._loop = asyncio.get_running_loop()
        started = time.perf_counter()
        count = self.config.instance_group.count
        name = f"{self.config.name}-v{self.version}"
        self.workers = [Worker(f"{name}-{i}", self._loop) for i in range(count)]
        try:
            self.instances = list(
                await asyncio.gather(*(w.call(self._build_instance) for w in self.workers))
            )
        except Exception as e:
            self.state = "failed"
            self.error = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
            self._stop_threads()
            raise LoadError(self.error) from e
        self.batcher = DynamicBatcher(
            self.config.name,
            self.config.max_batch_size,
            self.config.dynamic_batching,
            count,
            self._execute,
            LoopClock(self._loop),
        )
        self.load_seconds = time.perf_counter() - started
        self.state = "ready"

    def _build_instance(self) -> Model:
        device = _device(self.config.instance_group.kind)
        model = backend_class(self.config.backend)(self.config, self.version_dir, device)
        model.load()
        for warmup in self.config.model_warmup:
            request = Request(
                dummy_inputs(self.config, warmup.batch_size, warmup.inputs),
                warmup.batch_size,
                0.0,
            )
            for _ in range(warmup.count):
                try:
                    # The same path as a real batch: merge adds masks for ragged inputs.
                    outputs = model.predict(merge(self.config, [request]))
                    split(self.config, [request], outputs)
                except Exception as e:
                    raise LoadError(
                        f"{self.version_dir}: warmup '{warmup.name}' failed: "
                        f"{type(e).__name__}: {e}"
                    ) from e
        return model

    async def unload(self) -> None:
        self.state = "unloaded"
        for model, worker in zip(self.instances, self.workers, strict=True):
            await worker.call(model.unload)
        self._stop_threads()
        self.instances = []

    def _stop_threads(self) -> None:
        for worker in self.workers:
            worker.stop()

    # ------------------------------------------------------------- requests

    def submit(self, request: Request) -> None:
        assert self.batcher is not None
        self.batcher.submit(request)

    def _execute(self, slot: int, batch: list[Request]) -> None:
        self.workers[slot].submit(
            self._run, (slot, batch), lambda result, error: self._finish(slot, batch, result, error)
        )

    def _run(self, slot: int, batch: list[Request]) -> list[dict[str, np.ndarray]]:
        """On the instance's thread: merge, predict, split."""
        try:
            outputs = self.instances[slot].predict(merge(self.config, batch))
            return split(self.config, batch, outputs)
        except Exception as e:
            log.exception("model %s v%s failed on a batch", self.config.name, self.version)
            raise ExecutionError(f"model '{self.config.name}': {type(e).__name__}: {e}") from e

    def _finish(
        self, slot: int, batch: list[Request], results: Any, error: BaseException | None
    ) -> None:
        assert self.batcher is not None
        if error is not None:
            results = [None] * len(batch)
        for request, result in zip(batch, results, strict=True):
            request.finish(result, error)
        self.batcher.release(slot)


def _device(kind: str) -> str:
    if kind == "cpu":
        return "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    if kind == "gpu":
        raise LoadError("instance_group.kind is 'gpu' but no CUDA device is available")
    return "cpu"
