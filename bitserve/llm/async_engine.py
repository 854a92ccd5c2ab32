"""The engine for the server: its step loop runs on its own thread, apart from asyncio.

The HTTP server's event loop must never wait on a forward pass, and the forward pass
must not wait on the event loop. So `LLMEngine.step()` runs on a dedicated thread;
each request has an `asyncio.Queue` that the engine thread feeds through
`call_soon_threadsafe`. A lock orders engine mutations (abort) against steps: an abort
waits at most for the step in flight, then frees the request's blocks. A new request is
tokenized and validated on the caller's worker thread and handed over without that lock:
the loop admits every request that arrived during a step before it plans the next, so a
burst of requests starts together (waiting on the lock, they trickled in a few a step).

A request that fails inside a step raises `RequestFailed` to its caller alone. If the
loop itself dies, every waiting request gets `EngineDead` (503, retry), `on_death` tells
the supervisor (backends/llm.py), and `revive()` starts a fresh loop over the same
weights.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bitserve.llm.engine import LLMEngine, Prompt
from bitserve.llm.metrics import EngineMetrics
from bitserve.llm.outputs import RequestOutput
from bitserve.llm.sampling_params import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop crashed; requests fail with this (503) instead of hanging."""

    retry_after = 1  # the supervisor rebuilds the engine in about a second


class RequestFailed(RuntimeError):
    """This request alone failed inside a step; the engine goes on (500)."""


class AsyncLLMEngine:
    def __init__(self, model: str | Path, **kwargs: Any):
        self.engine = LLMEngine(model, **kwargs)
        self._lock = threading.Lock()
        self._pending: dict[str, Any] = {}  # prepared requests for the next step
        self._pending_lock = threading.Lock()  # held for a dict operation only
        self._work = threading.Event()
        # request id -> (its event loop, its queue, whether it wants every step's output)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.on_death: Callable[[BaseException], None] | None = None  # called on its thread
        self._thread = self._start_loop()

    def _start_loop(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="bitserve-llm-engine", daemon=True)
        thread.start()
        return thread

    def revive(self) -> None:
        """After the loop died: forget its requests and blocks, keep the weights, start a
        new loop. Requests added meanwhile were refused (EngineDead), none is lost."""
        self._thread.join(timeout=10)  # on_death runs on it just before it ends
        if self._thread.is_alive():
            raise RuntimeError("the engine loop is still running")
        with self._lock:
            self.engine.reset()
            with self._pending_lock:
                self._pending.clear()
            self._error = None
        self._thread = self._start_loop()

    @property
    def dead(self) -> BaseException | None:
        """Why the loop is not running (None while it runs)."""
        if self._error is None and not self._thread.is_alive() and not self._stopped:
            return RuntimeError("the engine thread is gone")
        return self._error

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped:
            self._gather()
            with self._lock:
                self._admit_pending()
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except BaseException as error:  # fail every waiting stream, never hang
                    self._error = error
                    self._fail_all(error)
            if self._error is not None:
                if self.on_death is not None:
                    self.on_death(self._error)
                return
            if not busy:
                self._work.wait(timeout=1.0)
                self._work.clear()
            self._deliver_step(outputs)

    def _gather(self) -> None:
        """New prompts arrived: before the step that starts them, give the requests
        arriving with them (a burst the event loop is still parsing) a short wait to
        share it (batch_wait); past it, they would wait out the whole step."""
        with self._pending_lock:
            tokens = sum(state.seq.num_prompt_tokens for state in self._pending.values())
        wait = self.engine.batch_wait(tokens) if tokens else 0.0
        if wait > 0:
            time.sleep(wait)

    def _admit_pending(self) -> None:
        """Under the lock: queue the requests that arrived since the last step."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for request_id, state in pending.items():
            try:
                self.engine.admit(state)
            except ValueError as error:
                self._deliver(request_id, error)

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
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
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
                if item.error is not None:
                    raise RequestFailed(f"request {request_id} failed: {item.error}")
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await asyncio.shield(asyncio.to_thread(self._abort, request_id))

    def _add(self, request_id, prompt, params, priority, stream=True) -> None:
        state = self.engine.prepare(request_id, prompt, params, priority, stream)
        with self._pending_lock:
            # the loop fails every stream (pending ones too) once it has set _error
            if self._error is not None:
                raise EngineDead(f"the LLM engine loop failed: {self._error!r}")
            self._pending[request_id] = state
        self._work.set()

    def _abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            with self._pending_lock:
                if self._pending.pop(request_id, None) is not None:
                    return None  # never admitted: nothing to free
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
