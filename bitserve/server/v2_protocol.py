"""The KServe v2 / Open Inference Protocol infer request and response, with Triton's
binary tensor extension.

A request body is JSON, or JSON followed by raw tensor bytes when the header
`Inference-Header-Content-Length` gives the JSON's length; each input with a
`binary_data_size` parameter takes its bytes from there, in input order. Every problem
becomes an `InvalidRequest` whose message names the field (a 400 `{"error": ...}`).
The handlers are in v2.py; the request they hand a model is `bitserve.inference`'s.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson

from bitserve.batching.collate import shape_key
from bitserve.config import ModelConfig, TensorSpec
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.server.classification import top_k
from bitserve.server.http import json_object
from bitserve.tensors import DATATYPES, TensorError, from_binary, from_json, to_binary, to_json

HEADER_LENGTH = "inference-header-content-length"


def parse_infer(config: ModelConfig, body: bytes, header_length: int | None) -> InferRequest:
    header, binary = _split_body(body, header_length)
    doc = json_object(header)
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidRequest("field 'inputs' must be a non-empty list")
    params = _params(doc, "request")
    inputs = _read_inputs(config, raw_inputs, binary)
    rows = _check_inputs(config, inputs)
    outputs, choices, classes = _read_outputs(config, doc.get("outputs"), params)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest("field 'id' must be a string")
    return InferRequest(
        inputs=inputs,
        rows=rows,
        shape_key=shape_key(config, inputs),
        id=request_id,
        outputs=outputs,
        binary=choices,
        classification=classes,
        priority=_int_param(params, "priority"),
        timeout_us=_int_param(params, "timeout"),
    )


def _split_body(body: bytes, header_length: int | None) -> tuple[bytes, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    if header_length < 0 or header_length > len(body):
        raise InvalidRequest(
            f"header Inference-Header-Content-Length is {header_length} but the body has "
            f"{len(body)} bytes"
        )
    view = memoryview(body)
    return bytes(view[:header_length]), view[header_length:]


def _params(doc: dict, where: str) -> dict:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest(f"field 'parameters' of the {where} must be an object")
    return params


def _int_param(params: dict, key: str) -> int:
    value = params.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
    return value


def _spec(config: ModelConfig, name: str) -> TensorSpec:
    spec = config.input_spec(name)
    if spec is None:
        expected = [t.name for t in config.input]
        raise InvalidRequest(f"unknown input '{name}'; model '{config.name}' expects {expected}")
    return spec


def _read_inputs(config: ModelConfig, raw: list, binary: memoryview) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequest("each entry of 'inputs' must be an object with a 'name'")
        name = item["name"]
        spec = _spec(config, name)
        if name in inputs:
            raise InvalidRequest(f"input '{name}' is given twice")
        datatype, shape = item.get("datatype"), item.get("shape")
        if datatype != spec.datatype:
            raise InvalidRequest(
                f"input '{name}': datatype {datatype!r}, model '{config.name}' expects "
                f"{spec.datatype}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InvalidRequest(f"input '{name}': 'shape' must be a list of non-negative ints")
        _check_shape(config, spec, shape)
        size = _params(item, f"input '{name}'").get("binary_data_size")
        try:
            if size is not None:
                if not isinstance(size, int) or size < 0:
                    raise InvalidRequest(f"input '{name}': binary_data_size must be an integer")
                if offset + size > len(binary):
                    raise InvalidRequest(
                        f"input '{name}': binary data truncated: binary_data_size is {size} "
                        f"but {len(binary) - offset} bytes remain"
                    )
                inputs[name] = from_binary(name, datatype, shape, binary[offset : offset + size])
                offset += size
            elif "data" in item:
                inputs[name] = from_json(name, datatype, shape, item["data"])
            else:
                raise InvalidRequest(f"input '{name}': needs 'data' or binary_data_size")
        except TensorError as e:
            raise InvalidRequest(str(e)) from None
        _check_range(spec, inputs[name])
    if offset != len(binary):
        raise InvalidRequest(
            f"body holds {len(binary) - offset} bytes of binary data that no input claims"
        )
    return inputs


def _check_shape(config: ModelConfig, spec: TensorSpec, shape: list[int]) -> None:
    """The shape a request declares must fit the config, before any data is decoded."""
    batched = config.max_batch_size > 0
    dims = shape[1:] if batched else shape
    if len(dims) != len(spec.dims) or any(
        d != e and e != -1 for d, e in zip(dims, spec.dims, strict=True)
    ):
        raise InvalidRequest(
            f"input '{spec.name}': shape {shape} does not match the model's "
            f"{config.full_shape(spec)}"
        )
    if batched and not 1 <= shape[0] <= config.max_batch_size:
        raise InvalidRequest(
            f"input '{spec.name}': batch size {shape[0]} is outside 1..{config.max_batch_size}"
        )


def _check_range(spec: TensorSpec, array: np.ndarray) -> None:
    if spec.value_range is None or not array.size:
        return
    low, high = spec.value_range
    if not (array.min() >= low and array.max() <= high):  # NaN is in no range
        raise InvalidRequest(
            f"input '{spec.name}': values must be in [{low:g}, {high:g}], got "
            f"[{array.min()}, {array.max()}]"
        )


def _check_inputs(config: ModelConfig, inputs: dict[str, np.ndarray]) -> int:
    """Every required input is there and all agree on the batch size (rows)."""
    missing = [t.name for t in config.input if t.name not in inputs and not t.optional]
    if missing:
        raise InvalidRequest(f"missing inputs {missing} for model '{config.name}'")
    if config.max_batch_size == 0:
        return 1
    rows = {name: a.shape[0] for name, a in inputs.items()}
    if len(set(rows.values())) > 1:
        raise InvalidRequest(f"inputs disagree on the batch size: {rows}")
    return next(iter(rows.values()))


def _read_outputs(
    config: ModelConfig, raw: Any, params: dict
) -> tuple[list[str], dict[str, bool], dict[str, int]]:
    default_binary = bool(params.get("binary_data_output", False))
    declared = [t.name for t in config.output]
    if raw is None:
        return declared, dict.fromkeys(declared, default_binary), {}
    if not isinstance(raw, list):
        raise InvalidRequest("field 'outputs' must be a list")
    names, choices, classes = [], {}, {}
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequest("each entry of 'outputs' must be an object with a 'name'")
        name = item["name"]
        if name not in declared:
            raise InvalidRequest(f"unknown output '{name}'; model '{config.name}' has {declared}")
        names.append(name)
        asked = _params(item, f"output '{name}'")
        choices[name] = bool(asked.get("binary_data", default_binary))
        if "classification" in asked:  # Triton's classification extension
            classes[name] = top_k(asked["classification"], name)
    return names, choices, classes


def encode_response(
    model: str, version: int, request: InferRequest, outputs: dict[str, np.ndarray]
) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the JSON header's length.

    JSON data holding NaN or an infinity is written `NaN`, `Infinity`, `-Infinity`, as
    Triton's writer does (rapidjson's kWriteNanAndInfFlag) and Python's json and
    tritonclient read them; orjson, strict JSON, would write null."""
    entries, blobs = [], []
    finite = True
    for name in request.outputs:
        array = outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": _datatype(array),
            "shape": list(array.shape),
        }
        if request.binary.get(name):
            blob = to_binary(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            try:
                entry["data"] = data = to_json(array)
            except TensorError as e:
                raise InvalidRequest(f"output '{name}': {e}") from None
            if isinstance(data, np.ndarray) and data.dtype.kind == "f":
                finite = finite and bool(np.isfinite(data).all())
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    if finite:
        header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    else:
        header = json.dumps(doc, separators=(",", ":"), default=np.ndarray.tolist).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _datatype(array: np.ndarray) -> str:
    if array.dtype == object:
        return "BYTES"
    for name, dtype in DATATYPES.items():
        if dtype == array.dtype:
            return name
    raise InvalidRequest(f"output dtype {array.dtype} has no v2 datatype")
