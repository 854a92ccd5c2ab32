"""BLS (Triton's "business logic scripting"): a python model calling served models.

A python model whose `setup` takes `models` gets this handle; in Triton's words:

    def setup(self, models):
        self.models = models

    def execute(self, requests):                  # or predict(self, inputs)
        ids = self.models.request("bow_tokenizer", {"text": texts}).exec()
        if ids.has_error():
            raise ids.error()
        probs = self.models.request(
            "bow_classifier", {"input_ids": ids.as_numpy("input_ids")},
            requested_output_names=["probs"],
        ).exec()

`exec()` blocks the model's own thread (never the server's loop); `async_exec()` is
awaited in an `async def predict/execute`, so several calls run at once; with
`decoupled=True` both give the responses as they come (an LLM's text piece by piece),
and leaving the loop early stops the generation. A call takes the request path of
every protocol (repository/calls.py), so the callee batches it with its other traffic;
its error comes back in the response (`has_error`, `error`: the callee's exception,
its message naming the model), `timeout` (microseconds, Triton's unit) bounds the
whole call (504 past it), and a call whose waiter is cancelled leaves the callee's queue.

The handle needs the model to run on a thread of the server (`isolation = "thread"`).
A model that calls itself, or one that exec()s a model that exec()s it back, waits on
its own instance: give such calls a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

_END = object()


class InferenceResponse:
    """One answer: the outputs by name, or the error that took their place."""

    def __init__(
        self, outputs: dict[str, np.ndarray] | None = None, error: Exception | None = None
    ):
        self.outputs = outputs or {}
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Exception | None:
        return self._error

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)

    def output_tensors(self) -> dict[str, np.ndarray]:
        return self.outputs


class InferenceRequest:
    """One call, not yet made: `exec()`, `async_exec()`, each optionally `decoupled`."""

    def __init__(
        self,
        models: Models,
        model_name: str,
        inputs: dict[str, Any],
        requested_output_names: list[str] | None = None,
        model_version: int | str = -1,
        timeout: int = 0,
    ):
        self.models, self.model_name, self.inputs = models, model_name, inputs
        self.outputs, self.version, self.timeout_us = requested_output_names, model_version, timeout

    def exec(self, decoupled: bool = False) -> Any:
        """The response (blocking this thread), or with `decoupled` an iterator of them."""
        if decoupled:
            return self.models.iterate(self._stream)
        return self.models.wait(self._call)

    def async_exec(self, decoupled: bool = False) -> Any:
        """An awaitable of the response, or with `decoupled` an async iterator of them."""
        if decoupled:
            return self.models.aiterate(self._stream)
        return self.models.await_(self._call)

    async def _call(self) -> dict[str, np.ndarray]:
        """The call on the server's loop. (The place for a tracing span per BLS call.)"""
        calls = self.models.calls
        return await calls.infer(
            self.model_name, self.inputs, self.outputs, self.version, self.timeout_us
        )

    def _stream(self) -> AsyncIterator[dict[str, np.ndarray]]:
        return self.models.calls.stream(self.model_name, self.inputs, self.version)


class Models:
    """The handle: `request(...)` builds a call; the rest carries calls between the
    model's thread (or its own event loop) and the server's loop."""

    def __init__(self, calls: Any, loop: asyncio.AbstractEventLoop):
        self.calls = calls  # repository.calls.ModelCalls
        self.loop = loop  # the server's event loop

    def request(
        self,
        model_name: str,
        inputs: dict[str, Any],
        requested_output_names: list[str] | None = None,
        model_version: int | str = -1,
        timeout: int = 0,
    ) -> InferenceRequest:
        return InferenceRequest(
            self, model_name, inputs, requested_output_names, model_version, timeout
        )

    def _submit(self, coroutine: Any) -> Any:
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self.loop:
            coroutine.close()
            raise RuntimeError(
                "BLS calls are made from a model's predict/execute, not the server loop"
            )
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def wait(self, call: Callable[[], Any]) -> InferenceResponse:
        try:
            return InferenceResponse(self._submit(call()).result())
        except Exception as e:
            return InferenceResponse(error=e)

    async def await_(self, call: Callable[[], Any]) -> InferenceResponse:
        try:
            return InferenceResponse(await asyncio.wrap_future(self._submit(call())))
        except Exception as e:
            return InferenceResponse(error=e)

    def iterate(self, stream: Callable[[], AsyncIterator]) -> Iterator[InferenceResponse]:
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        pumping = self._submit(_pump(stream, pieces.put))
        try:
            while (item := pieces.get()) is not _END:
                yield _response(item)
        finally:
            pumping.cancel()  # left early: the generation stops

    async def aiterate(
        self, stream: Callable[[], AsyncIterator]
    ) -> AsyncIterator[InferenceResponse]:
        here = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        pumping = self._submit(
            _pump(stream, lambda x: here.call_soon_threadsafe(pieces.put_nowait, x))
        )
        try:
            while (item := await pieces.get()) is not _END:
                yield _response(item)
        finally:
            pumping.cancel()


async def _pump(stream: Callable[[], AsyncIterator], put: Callable[[Any], None]) -> None:
    """On the server's loop: each response of the stream to the model's side, then an
    error if one ended it, then the end."""
    try:
        async with contextlib.aclosing(stream()) as items:
            async for item in items:
                put(item)
    except Exception as e:
        put(e)
    finally:
        put(_END)


def _response(item: Any) -> InferenceResponse:
    return InferenceResponse(error=item) if isinstance(item, Exception) else InferenceResponse(item)
