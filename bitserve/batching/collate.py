"""Merge requests into one batch and split the outputs back, one slice per caller.

Fixed-shape inputs are concatenated along the batch dimension (a single request is
passed through untouched: no copy). Ragged inputs (token sequences) are padded to the
batch's longest along their variable dimension, and their `mask` input (1 = real,
0 = pad) is built alongside. Outputs are cut back by row offsets as numpy views, so a
caller gets exactly its own rows and nothing is copied on the way out. A model that
takes its batch as requests (`run`: a python model's `execute`) gives each request its
own outputs, whose shapes may differ from one request to the next.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bitserve.batching.batcher import Request
from bitserve.config import ModelConfig, TensorSpec
from bitserve.tensors import DATATYPES, coerce


def shape_key(config: ModelConfig, inputs: dict[str, np.ndarray]) -> tuple:
    """What must agree for requests to share a batch: every fixed-shape input's shape
    past the batch dimension (ragged inputs are padded, so they never disagree)."""
    if config.max_batch_size == 0:
        return ()
    ragged = {t.name for t in config.input if t.ragged}
    return tuple((name, a.shape[1:]) for name, a in inputs.items() if name not in ragged)


def merge(config: ModelConfig, batch: list[Request]) -> dict[str, np.ndarray]:
    if config.max_batch_size == 0:
        return batch[0].inputs
    merged: dict[str, np.ndarray] = {}
    for spec in config.input:
        arrays = [r.inputs[spec.name] for r in batch if spec.name in r.inputs]
        if not arrays:
            continue  # an optional input nobody sent
        if len(arrays) != len(batch):
            raise ValueError(f"optional input '{spec.name}' given by only some requests")
        if spec.ragged:
            merged[spec.name], mask = _pad(spec, arrays)
            if spec.mask:
                merged[spec.mask] = mask
        elif len(arrays) == 1:
            merged[spec.name] = arrays[0]
        else:
            merged[spec.name] = np.concatenate(arrays, axis=0)
    return merged


def _pad(spec: TensorSpec, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pad along the first variable dimension (axis 1 + its index in dims)."""
    axis = 1 + spec.dims.index(-1)
    longest = max(a.shape[axis] for a in arrays)
    rows = sum(a.shape[0] for a in arrays)
    shape = list(arrays[0].shape)
    shape[0], shape[axis] = rows, longest
    out = np.full(shape, spec.pad_value, dtype=arrays[0].dtype)
    mask = np.zeros((rows, longest), dtype=np.int64)
    start = 0
    for a in arrays:
        index = [slice(start, start + a.shape[0])] + [slice(None)] * (a.ndim - 1)
        index[axis] = slice(0, a.shape[axis])
        out[tuple(index)] = a
        mask[start : start + a.shape[0], : a.shape[axis]] = 1
        start += a.shape[0]
    return out, mask


def split(
    config: ModelConfig, batch: list[Request], outputs: dict[str, Any]
) -> list[dict[str, np.ndarray]]:
    """Per-request outputs, in `batch` order; checks the model returned what it declared."""
    arrays: dict[str, np.ndarray] = {}
    for spec in config.output:
        if spec.name not in outputs:
            raise RuntimeError(f"model '{config.name}' returned no output '{spec.name}'")
        arrays[spec.name] = coerce(outputs[spec.name], spec.datatype)
    if config.max_batch_size == 0:
        return [arrays]
    rows = sum(r.rows for r in batch)
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != rows:
            raise RuntimeError(
                f"model '{config.name}' output '{name}' has shape {list(array.shape)}; "
                f"its first dimension must be the batch size {rows}"
            )
    result, start = [], 0
    for request in batch:
        end = start + request.rows
        result.append({name: array[start:end] for name, array in arrays.items()})
        start = end
    return result


def run(config: ModelConfig, model: Any, batch: list[Request]) -> list[dict[str, np.ndarray]]:
    """One batch through a model: merge, predict, split; or, for a model that takes its
    batch as requests (a python model's `execute`), each request's own outputs."""
    execute = getattr(model, "execute", None)
    if execute is None:
        return split(config, batch, model.predict(merge(config, batch)))
    answers = execute([r.inputs for r in batch])
    return [_own(config, r, a) for r, a in zip(batch, answers, strict=True)]


def _own(config: ModelConfig, request: Request, outputs: Any) -> Any:
    """One request's outputs from a per-request model, checked like `split`'s; an
    exception in their place fails that request alone (Triton's per-response error)."""
    if isinstance(outputs, Exception):
        return outputs
    own = {}
    for spec in config.output:
        if spec.name not in outputs:
            raise RuntimeError(f"model '{config.name}' returned no output '{spec.name}'")
        array = own[spec.name] = coerce(outputs[spec.name], spec.datatype)
        if config.max_batch_size > 0 and (array.ndim == 0 or array.shape[0] != request.rows):
            raise RuntimeError(
                f"model '{config.name}' output '{spec.name}' has shape {list(array.shape)}; "
                f"its first dimension must be the request's batch size {request.rows}"
            )
    return own


def dummy_inputs(config: ModelConfig, rows: int, spec_inputs: dict) -> dict[str, np.ndarray]:
    """Inputs for a warmup request (zero, random or literal data)."""
    rng = np.random.default_rng(0)
    inputs = {}
    for name, w in spec_inputs.items():
        spec = config.input_spec(name)
        assert spec is not None
        shape = ([rows] if config.max_batch_size > 0 else []) + (
            list(w.dims) or [max(d, 1) for d in spec.dims]
        )
        row_shape = shape[1:] if config.max_batch_size > 0 else shape
        dtype = DATATYPES[spec.datatype]
        if spec.datatype == "BYTES":
            values = [s.encode() if isinstance(s, str) else s for s in (w.data or ["warmup"])]
            row = np.empty(len(values), dtype=object)
            row[:] = values
            array = np.broadcast_to(row.reshape(row_shape), shape).copy()
        elif w.data is not None:
            row = np.asarray(w.data, dtype=np.float64).astype(dtype).reshape(row_shape)
            array = np.broadcast_to(row, shape).copy()
        elif w.random_data and dtype.kind == "f":
            array = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        elif w.random_data:
            array = rng.integers(0, 2 if dtype.kind == "b" else 10, shape).astype(dtype)
        else:
            array = np.zeros(shape, dtype=dtype)
        inputs[name] = array
    return inputs
