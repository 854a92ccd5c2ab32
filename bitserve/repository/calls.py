"""How one served model calls another: an ensemble's steps and a python model's BLS
calls (backends/bls.py) come through here, on the event loop.

A call takes the path every protocol takes below its codec: the model is looked up in
the repository (loaded first when it is lazy), its inputs become one `InferRequest`
checked against its config as v2 infer checks a request (a 400 naming the field), and
`ModelVersion.start` queues it at its model's batcher, its LLM engine or its response
cache. No loopback HTTP: tensors stay numpy arrays from caller to callee.

Every call ends: with the outputs, with the callee's own error (its type, so its status,
kept), or with QueueTimeout (504) when `timeout_us` passes; a caller that is cancelled
(its client left) takes the call out of the callee's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from bitserve.batching.batcher import QueueTimeout
from bitserve.batching.collate import shape_key
from bitserve.config import ModelConfig
from bitserve.inference import ClientGone, InferRequest, InvalidRequest
from bitserve.tensors import TensorError, datatype_of


class ModelCalls:
    def __init__(self, repository: Any):
        self.repository = repository  # the Repository (it builds this; no import back)

    async def lookup(self, model: str, version: int | str | None = None) -> Any:
        """The served ModelVersion (`version` None or -1: the highest ready one)."""
        await self.repository.ensure_loaded(model)
        pinned = None if version in (None, -1, "-1", "") else str(version)
        return self.repository.get(model, pinned)

    async def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        outputs: list[str] | None = None,
        version: int | str | None = None,
        timeout_us: int = 0,
        priority: int = 0,
    ) -> dict[str, np.ndarray]:
        """One inference on `model`: its outputs by name (those asked for, else all)."""
        served = await self.lookup(model, version)
        request = request_for(served.config, inputs, outputs, timeout_us, priority)
        started = time.perf_counter()
        served.m["inflight"].inc()
        try:
            ticket = served.start(request)
            try:
                async with asyncio.timeout(timeout_us / 1e6 if timeout_us else None):
                    answer = await ticket.result
            except TimeoutError:
                ticket.cancel(QueueTimeout(f"model '{model}': no answer in {timeout_us} us"))
                raise QueueTimeout(f"model '{model}': no answer in {timeout_us} us") from None
            except asyncio.CancelledError:
                ticket.cancel(ClientGone("the calling request was cancelled"))
                raise
        finally:
            served.m["inflight"].dec()
            served.m["duration"].observe(time.perf_counter() - started)
        served.m["success"].inc()
        return {name: answer[name] for name in request.outputs}

    async def stream(
        self, model: str, inputs: dict[str, Any], version: int | str | None = None
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """The responses of one call as they come: an LLM's `text_output` piece by piece
        (its generate front door, as generate_stream); any other model's one answer.
        Closing the iterator early stops the generation and frees its KV blocks."""
        served = await self.lookup(model, version)
        if not served.serves("generate"):
            yield await self.infer(model, inputs, version=version)
            return
        request = request_for(served.config, inputs, None, 0, 0)
        llm = served.serving("generate")
        admitted = llm.text_request(request.inputs)  # 4xx / 503 / 429 before it starts
        lease = served.begin()
        try:
            async with contextlib.aclosing(llm.generate(admitted)) as outs:
                async for out in outs:
                    piece = out.outputs[0].delta_text
                    if piece:
                        yield {"text_output": np.array([piece.encode()], dtype=object)}
        finally:
            lease.release()


def request_for(
    config: ModelConfig,
    inputs: dict[str, Any],
    outputs: list[str] | None,
    timeout_us: int = 0,
    priority: int = 0,
) -> InferRequest:
    """Arrays (numpy, or anything np.asarray takes; str for BYTES) as the one request,
    checked against `config` as the v2 codec checks a wire request."""
    arrays = {name: _array(config, name, value) for name, value in inputs.items()}
    missing = [t.name for t in config.input if t.name not in arrays and not t.optional]
    if missing:
        raise InvalidRequest(f"missing inputs {missing} for model '{config.name}'")
    rows = 1
    if config.max_batch_size > 0:
        sizes = {name: a.shape[0] for name, a in arrays.items()}
        if len(set(sizes.values())) > 1:
            raise InvalidRequest(f"inputs disagree on the batch size: {sizes}")
        rows = next(iter(sizes.values()), 1)
    declared = [t.name for t in config.output]
    unknown = [name for name in outputs or () if name not in declared]
    if unknown:
        raise InvalidRequest(f"unknown outputs {unknown}; model '{config.name}' has {declared}")
    return InferRequest(
        inputs=arrays,
        rows=rows,
        shape_key=shape_key(config, arrays),
        outputs=list(outputs or declared),
        priority=priority,
        timeout_us=timeout_us,
    )


def _array(config: ModelConfig, name: str, value: Any) -> np.ndarray:
    spec = config.input_spec(name)
    if spec is None:
        expected = [t.name for t in config.input]
        raise InvalidRequest(f"unknown input '{name}'; model '{config.name}' expects {expected}")
    array = np.asarray(value)
    if array.dtype.kind in "SU" or (array.dtype == object and spec.datatype == "BYTES"):
        array = np.vectorize(_utf8, otypes=[object])(array) if array.size else array.astype(object)
    try:
        datatype = datatype_of(array)
    except TensorError as e:
        raise InvalidRequest(f"input '{name}': {e}") from None
    if datatype != spec.datatype:
        raise InvalidRequest(
            f"input '{name}': datatype {datatype}, model '{config.name}' expects {spec.datatype}"
        )
    batched = config.max_batch_size > 0
    dims = list(array.shape[1:] if batched else array.shape)
    fits = len(dims) == len(spec.dims) and all(
        e in (-1, d) for d, e in zip(dims, spec.dims, strict=False)
    )
    if not fits or (batched and not 1 <= array.shape[0] <= config.max_batch_size):
        raise InvalidRequest(
            f"input '{name}': shape {list(array.shape)} does not fit the model's "
            f"{config.full_shape(spec)} (batch size at most {config.max_batch_size})"
        )
    if spec.value_range is not None and array.size:
        low, high = spec.value_range
        if not (array.min() >= low and array.max() <= high):
            raise InvalidRequest(f"input '{name}': values must be in [{low:g}, {high:g}]")
    return array


def _utf8(item: Any) -> bytes:
    return item.encode() if isinstance(item, str) else bytes(item)
