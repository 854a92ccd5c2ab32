"""The response cache of one model version (Triton's `response_cache`): outputs kept by
a hash of the model, its version and the request's inputs, so that an identical request
is answered without queueing (a hit takes no batch slot).

Invariants: the entries' bytes never exceed `max_bytes` (the least recently used go
first; an answer larger than the whole bound is not kept); a kept answer is a private,
read-only copy (never a view that would pin its batch's arrays); an llm model's answer
is kept only when it is greedy (temperature 0), so sampled text is never replayed.
What the key leaves out changes no output: priority, timeout, the outputs asked for and
their encoding are applied to the whole answer after it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np

from bitserve.config import ModelConfig
from bitserve.inference import InvalidRequest, text_inputs
from bitserve.metrics import Metrics


class ResponseCache:
    def __init__(self, config: ModelConfig, version: int, metrics: Metrics):
        self.model, self.version = config.name, version
        labels = (config.name, str(version))
        self.hits = metrics.cache_hits.labels(*labels)
        self.misses = metrics.cache_misses.labels(*labels)
        self.evictions = metrics.cache_evictions.labels(*labels)
        self.held = metrics.cache_bytes.labels(*labels)
        self.llm = config.backend == "llm"
        self.max_bytes = config.response_cache.max_bytes
        self.entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self.bytes = 0

    def key(self, inputs: dict[str, np.ndarray]) -> bytes | None:
        """The request's key, or None when its answer must not be cached (sampled)."""
        if self.llm and not _greedy(inputs):
            return None
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{self.model}\0{self.version}".encode())
        for name in sorted(inputs):
            array = inputs[name]
            h.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
            if array.dtype == object:
                for item in array.flat:
                    data = item if isinstance(item, bytes) else str(item).encode()
                    h.update(len(data).to_bytes(8, "little"))
                    h.update(data)
            else:
                h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        return h.digest()

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        found = self.entries.get(key)
        if found is None:
            self.misses.inc()
            return None
        self.entries.move_to_end(key)
        self.hits.inc()
        return dict(found[0])

    def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        kept = {name: _frozen(array) for name, array in outputs.items()}
        size = len(key) + sum(_size(a) for a in kept.values())
        if size > self.max_bytes or key in self.entries:
            return
        while self.bytes + size > self.max_bytes:
            _, (_, freed) = self.entries.popitem(last=False)
            self.bytes -= freed
            self.evictions.inc()
        self.entries[key] = (kept, size)
        self.bytes += size
        self.held.set(self.bytes)


def _greedy(inputs: dict[str, np.ndarray]) -> bool:
    """Whether an llm request's `sampling_parameters` ask for greedy decoding (the
    default temperature, 1.0, samples)."""
    try:
        _, parameters = text_inputs(inputs)
    except InvalidRequest:
        return False  # the path refuses it anyway
    temperature = parameters.get("temperature", 1.0) if isinstance(parameters, dict) else 1.0
    return isinstance(temperature, int | float) and temperature == 0


def _frozen(array: Any) -> np.ndarray:
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy


def _size(array: np.ndarray) -> int:
    if array.dtype == object:
        return array.nbytes + sum(len(x) if isinstance(x, bytes | str) else 8 for x in array.flat)
    return array.nbytes
