"""The engine for the server: its step loop runs on its own thread, apart from asyncio.

The HTTP server's event loop must never wait on a forward pass, and the forward pass
must not wait on the event loop. So `LLMEngine.step()` runs on a dedicated thread;
each request has an `asyncio.Queue` that the engine thread feeds through
`call_soon_threadsafe`. A lock orders engine mutations (add, abort) against steps:
an abort waits at most for the step in flight, then frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bitserve.llm.engine import LLMEngine, Prompt
from bitserve.llm.metrics import EngineMetrics
from bitserve.llm.outputs import RequestOutput
from bitserve.llm.sampling_params import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop crashed; requests fail with this instead of hanging."""


class AsyncLLMEngine:
    def __init__(self, model: str | Path, **kwargs: Any):
        self.engine = LLMEngine(model, **kwargs)
        self._lock = threading.Lock()
        self._work = threading.Event()
        # request id -> (its event loop, its queue, whether it wants every step's output)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="bitserve-llm-engine", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except BaseException as error:  # fail every waiting stream, never hang
                    self._error = error
                    self._fail_all(error)
                    return
            if not busy:
                self._work.wait(timeout=1.0)
                self._work.clear()
            self._deliver_step(outputs)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step, carrying every output it waits for:
        a thread-to-loop hop per token per request cost more than a tiny model's step."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and (stream[2] or out.finished):
                batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue, _ = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(f"the LLM engine loop failed: {error!r}"))

    # -- the asyncio side -----------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gets tokens; the last is finished.
        With `stream=False` only the finished one comes (batch jobs need only the end).
        Leaving the loop early (a client that disconnects) aborts the request."""
        if self._error is not None:
            raise EngineDead(f"the LLM engine loop failed: {self._error!r}")
        request_id = request_id or f"async-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue, stream)
        finished = False
        try:
            await asyncio.to_thread(self._add, request_id, prompt, params, priority, stream)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await asyncio.shield(asyncio.to_thread(self._abort, request_id))

    def _add(self, request_id, prompt, params, priority, stream=True) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt, params, priority, stream)
        self._work.set()

    def _abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            return self.engine.abort_request(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are back in the pool when this returns."""
        out = await asyncio.to_thread(self._abort, request_id)
        if out is not None:
            self._deliver(request_id, out)

    def metrics(self) -> EngineMetrics:
        with self._lock:
            return self.engine.metrics()

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)
        # a step still running waits on the workers: kill them rather than talk over it
        self.engine.shutdown(wait=not self._thread.is_alive())


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
