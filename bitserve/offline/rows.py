"""Plain rows (JSONL objects, CSV, Parquet) as KServe v2 inputs of one model.

A column mapping names the column behind each model input (`--map text=sentence`);
an input without one reads the column of its own name. CSV cells are text, so a
non-BYTES cell is read as JSON (`[0.1, 0.2]`, `3`). The answer body is the v2 response
the server would send (`bitserve.api.v2.encode_response`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from bitserve.api.v2 import encode_response
from bitserve.config import ModelConfig
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.repository.version import ModelVersion
from bitserve.tensors import from_json


@dataclass
class RowMapping:
    model: str
    columns: dict[str, str] = field(default_factory=dict)  # model input -> column
    id_column: str | None = None


def parse_mapping(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`input=column` pairs from the command line."""
    out = {}
    for item in items:
        name, sep, column = item.partition("=")
        if not sep or not name or not column:
            raise ValueError(f"--map takes input=column, got {item!r}")
        out[name] = column
    return out


def row_inputs(config: ModelConfig, mapping: RowMapping, row: dict) -> tuple[dict, int]:
    """One-row input arrays, and the row's length (for bucketing similar rows together)."""
    if config.max_batch_size == 0:
        raise InvalidRequest(f"model '{config.name}' does not batch; bitserve batch needs rows")
    inputs, length = {}, 1
    for spec in config.input:
        column = mapping.columns.get(spec.name, spec.name)
        value = row.get(column)
        if value is None or value == "":
            if spec.optional:
                continue
            raise InvalidRequest(f"input '{spec.name}': the row has no column {column!r}")
        if isinstance(value, str) and spec.datatype != "BYTES":
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as e:
                raise InvalidRequest(f"input '{spec.name}': the cell is not JSON: {e}") from None
        shape = [1, *np.shape(value)] if isinstance(value, list) else [1] * (len(spec.dims) + 1)
        _check_dims(spec.name, spec.dims, shape[1:])
        array = from_json(spec.name, spec.datatype, shape, value)
        inputs[spec.name] = array
        length = max(length, len(value) if isinstance(value, str | list) else 1)
    return inputs, length


def _check_dims(name: str, dims: list[int], shape: list[int]) -> None:
    if len(dims) != len(shape) or any(d != e and e != -1 for d, e in zip(shape, dims, strict=True)):
        raise InvalidRequest(f"input '{name}': a row of shape {shape} does not match dims {dims}")


def v2_body(version: ModelVersion, outputs: dict[str, Any]) -> dict:
    config = version.config
    request = InferRequest(inputs={}, rows=1, shape_key=(), outputs=[t.name for t in config.output])
    header, _ = encode_response(config.name, version.version, request, outputs)
    return orjson.loads(header)
