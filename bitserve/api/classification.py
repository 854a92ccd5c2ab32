"""Triton's classification extension, for the v2 protocol over HTTP and gRPC alike.

A requested output with `parameters.classification = k` comes back as the k highest
scores instead of the whole vector: BYTES strings `"score:index:label"`, highest first
(ties by the lower index), where the label is line `index` of the output's `labels`
file in the model's folder (Triton's `label_filename`), and `"score:index"` when the
output has none. A batched model classifies each row alone, so `[rows, n]` becomes
`[rows, min(k, n)]`; a model without a batch dimension ranks all its elements at once.
The score is printed as C's `%f` (Triton's `std::to_string`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from bitserve.inference import InferRequest, InvalidRequest
from bitserve.repository.version import ModelVersion


def top_k(value: object, output: str) -> int:
    """The `classification` parameter of a requested output, checked."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(
            f"output '{output}': parameter 'classification' must be a positive integer"
        )
    return value


def apply(version: ModelVersion, request: InferRequest, outputs: dict) -> dict:
    """The outputs with every output the request classifies replaced by its top k."""
    if not request.classification:
        return outputs
    outputs = dict(outputs)
    for name, k in request.classification.items():
        batched = version.config.max_batch_size > 0
        outputs[name] = classify(outputs[name], k, labels(version, name), batched)
    return outputs


def classify(scores: np.ndarray, k: int, names: list[str] | None, batched: bool) -> np.ndarray:
    if scores.dtype.kind not in "biuf" and scores.dtype.name != "bfloat16":
        raise InvalidRequest("parameter 'classification' needs a numeric output")
    batched = batched and scores.ndim > 0
    rows = scores.reshape(scores.shape[0] if batched else 1, -1).astype(np.float64)
    keep = min(k, rows.shape[1])
    order = np.argsort(-rows, axis=1, kind="stable")[:, :keep]
    out = np.empty(order.shape, dtype=object)
    for r, c in np.ndindex(*order.shape):
        index = int(order[r, c])
        text = f"{rows[r, index]:f}:{index}"
        if names is not None and index < len(names):
            text += f":{names[index]}"
        out[r, c] = text.encode()
    return out if batched else out.reshape(keep)


def labels(version: ModelVersion, output: str) -> list[str] | None:
    spec = next(t for t in version.config.output if t.name == output)
    if spec.labels is None:
        return None
    path = version.version_dir.parent / spec.labels
    return _read(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _read(path: str, mtime_ns: int) -> list[str]:
    """One label per line; cached until the file changes (a reload may edit it)."""
    return Path(path).read_text().splitlines()
