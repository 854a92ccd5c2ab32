"""The v2 protocol's gRPC wire format: a `ModelInferRequest` becomes the one
`InferRequest` (bitserve/inference.py), outputs become a `ModelInferResponse`, and an
exception becomes a gRPC status code.

An input's data comes from `raw_input_contents` (one entry per input, in input order,
laid out as Triton's binary tensor extension), or from its typed `contents` when no
raw contents are sent; outputs always go back as `raw_output_contents`, as Triton's.
The checks are v2_protocol's (the same shapes, ranges and messages naming the field);
request parameters `priority`, `timeout` and, per output, `classification` are read
as over HTTP. Codes follow Triton's: the HTTP status of errors.py picks one, so the
two protocols cannot disagree about an exception.
"""

from __future__ import annotations

import math

import grpc
import numpy as np

from bitserve.batching.collate import shape_key
from bitserve.config import ModelConfig
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.server.classification import top_k
from bitserve.server.errors import status_of
from bitserve.server.proto import grpc_service_pb2 as pb
from bitserve.server.v2_protocol import _check_inputs, _check_range, _check_shape, _spec
from bitserve.tensors import DATATYPES, TensorError, datatype_of, from_binary, to_binary

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# datatype -> (the typed field of InferTensorContents, the numpy dtype its values take)
CONTENTS = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int64),
    "INT16": ("int_contents", np.int64),
    "INT32": ("int_contents", np.int64),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint64),
    "UINT16": ("uint_contents", np.uint64),
    "UINT32": ("uint_contents", np.uint64),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", object),
}


def code_of(exc: BaseException) -> grpc.StatusCode:
    return CODES.get(status_of(exc), grpc.StatusCode.INTERNAL)


def parse_infer(
    config: ModelConfig, request: pb.ModelInferRequest, deadline_s: float | None
) -> InferRequest:
    """The request, checked against the model's config. A client deadline becomes the
    request's queue timeout, so the batcher drops it unrun once the deadline passes."""
    if not request.inputs:
        raise InvalidRequest("field 'inputs' must be a non-empty list")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"field 'raw_input_contents' has {len(raw)} entries for {len(request.inputs)} inputs"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in inputs:
            raise InvalidRequest(f"input '{tensor.name}' is given twice")
        inputs[tensor.name] = _read_input(config, tensor, raw[i] if raw else None)
    rows = _check_inputs(config, inputs)
    params = request.parameters
    timeout_us = _int_param(params, "timeout")
    if deadline_s is not None:
        left = max(1, int(deadline_s * 1e6))
        timeout_us = min(timeout_us, left) if timeout_us else left
    outputs, classification = _read_outputs(config, request.outputs)
    return InferRequest(
        inputs=inputs,
        rows=rows,
        shape_key=shape_key(config, inputs),
        id=request.id or None,
        outputs=outputs,
        classification=classification,
        priority=_int_param(params, "priority"),
        timeout_us=timeout_us,
    )


def _read_input(
    config: ModelConfig, tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None
) -> np.ndarray:
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    spec = _spec(config, name)
    if datatype != spec.datatype:
        raise InvalidRequest(
            f"input '{name}': datatype {datatype!r}, model '{config.name}' expects {spec.datatype}"
        )
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"input '{name}': 'shape' must hold non-negative sizes, got {shape}")
    _check_shape(config, spec, shape)
    try:
        if raw is not None:
            if tensor.HasField("contents"):
                raise InvalidRequest(
                    f"input '{name}': give its data in 'contents' or in 'raw_input_contents', "
                    "not both"
                )
            array = from_binary(name, datatype, shape, raw)
        else:
            array = _from_contents(name, datatype, shape, tensor.contents)
    except TensorError as e:
        raise InvalidRequest(str(e)) from None
    _check_range(spec, array)
    return array


def _from_contents(
    name: str, datatype: str, shape: list[int], contents: pb.InferTensorContents
) -> np.ndarray:
    if datatype not in CONTENTS:
        raise InvalidRequest(f"input '{name}': {datatype} data must come in raw_input_contents")
    field, wide = CONTENTS[datatype]
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidRequest(
            f"input '{name}': contents.{field} holds {len(values)} values, shape {shape} "
            f"needs {count}"
        )
    if wide is object:
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    array = np.array(values, dtype=wide)
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidRequest(
                f"input '{name}': contents.{field} has values outside {datatype}'s range "
                f"[{info.min}, {info.max}]"
            )
    return array.astype(dtype, copy=False).reshape(shape)


def _int_param(params: dict, key: str) -> int:
    if key not in params:
        return 0
    value = params[key]
    if value.WhichOneof("parameter_choice") not in ("int64_param", "uint64_param"):
        raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
    number = value.int64_param or value.uint64_param
    if number < 0:
        raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
    return number


def _read_outputs(config: ModelConfig, asked: list) -> tuple[list[str], dict[str, int]]:
    declared = [t.name for t in config.output]
    if not asked:
        return declared, {}
    names, classification = [], {}
    for output in asked:
        if output.name not in declared:
            raise InvalidRequest(
                f"unknown output '{output.name}'; model '{config.name}' has {declared}"
            )
        names.append(output.name)
        if "classification" in output.parameters:
            value = output.parameters["classification"]
            k = value.int64_param if value.WhichOneof("parameter_choice") == "int64_param" else 0
            classification[output.name] = top_k(k, output.name)
    return names, classification


def encode_response(
    model: str,
    version: int,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    response: pb.ModelInferResponse | None = None,
) -> pb.ModelInferResponse:
    """The response message, or `response` filled in (a stream's `infer_response`,
    which then needs no copy into its envelope)."""
    if response is None:
        response = pb.ModelInferResponse()
    response.model_name = model
    response.model_version = str(version)
    if request.id is not None:
        response.id = request.id
    for name in request.outputs:
        array = outputs[name]
        try:
            datatype = "BYTES" if array.dtype == object else datatype_of(array)
        except TensorError as e:
            raise InvalidRequest(f"output '{name}': {e}") from None
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(to_binary(array))
    return response
