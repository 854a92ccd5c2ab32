"""The KServe v2 / Open Inference Protocol's messages, for HTTP and gRPC alike: the one
codec both front-ends (v2.py, grpc_server.py) call.

A request becomes the one `InferRequest` (bitserve/inference.py) and outputs become a
response, checked in one place whichever wire brought them:
- HTTP: a JSON body, or JSON followed by raw tensor bytes when the header
  `Inference-Header-Content-Length` gives the JSON's length (Triton's binary tensor
  extension); each input with a `binary_data_size` parameter takes its bytes from there,
  in input order. Outputs are JSON data, or binary where `binary_data` asks for it.
- gRPC: a `ModelInferRequest`, its data in `raw_input_contents` (one entry per input,
  laid out as the binary extension) or in typed `contents`; outputs always go back as
  `raw_output_contents`, as Triton's.
Both read the request parameters `priority` and `timeout` and an output's
`classification` (an llm model's `text_input` and `sampling_parameters` are read by
`bitserve.inference.text_inputs`, below the backends, which can read them there too).
Every problem
becomes an `InvalidRequest` whose message names the field (400 / INVALID_ARGUMENT).
Model metadata, config and statistics are encoded here too.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bitserve.api.classification import top_k
from bitserve.api.jsonbody import json_object
from bitserve.batching.collate import shape_key
from bitserve.config import ModelConfig, TensorSpec
from bitserve.inference import InferRequest, InvalidRequest
from bitserve.repository.repository import ModelEntry, Repository
from bitserve.repository.version import ModelVersion
from bitserve.tensors import (
    DATATYPES,
    TensorError,
    datatype_of,
    from_binary,
    from_json,
    to_binary,
    to_json,
)

if TYPE_CHECKING:  # the stubs load when a gRPC message is built (grpc_messages)
    from bitserve.api.proto import grpc_service_pb2 as pb

HEADER_LENGTH = "inference-header-content-length"

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

# (name, datatype, shape, read the data): one input as a wire gives it
WireInput = tuple[str, Any, Any, Callable[[], np.ndarray]]
# the server's shared-memory regions (bitserve/server/shm.py's SharedMemory), or None
Shm = Any


# ------------------------------------------------------------ the one request


def infer_request(
    config: ModelConfig,
    inputs: Iterable[WireInput],
    params: dict,
    outputs: list[tuple[str, dict]] | None,
    request_id: str | None,
    binary_default: bool = False,
    after_inputs: Callable[[], None] | None = None,
    shm: Shm = None,
) -> InferRequest:
    """The request both wires decode into: each input checked against the model's
    config before its data is read (`after_inputs` runs once all are read), then the
    batch size, the requested outputs (name, parameters; an output asked into `shm`, the
    server's shared-memory regions, is placed there) and the request parameters."""
    arrays: dict[str, np.ndarray] = {}
    for name, datatype, shape, read in inputs:
        arrays[name] = read_input(config, arrays, name, datatype, shape, read)
    if after_inputs is not None:
        after_inputs()
    rows = check_inputs(config, arrays)
    names, binary, classification = read_outputs(config, outputs, binary_default)
    placed = shm_outputs(shm, outputs, classification)
    return InferRequest(
        inputs=arrays,
        rows=rows,
        shape_key=shape_key(config, arrays),
        id=request_id,
        outputs=names,
        binary=binary,
        classification=classification,
        shm=placed,
        priority=int_param(params, "priority"),
        timeout_us=int_param(params, "timeout"),
    )


def read_input(
    config: ModelConfig,
    seen: dict[str, np.ndarray],
    name: str,
    datatype: Any,
    shape: Any,
    read: Callable[[], np.ndarray],
) -> np.ndarray:
    spec = config.input_spec(name)
    if spec is None:
        expected = [t.name for t in config.input]
        raise InvalidRequest(f"unknown input '{name}'; model '{config.name}' expects {expected}")
    if name in seen:
        raise InvalidRequest(f"input '{name}' is given twice")
    if datatype != spec.datatype:
        raise InvalidRequest(
            f"input '{name}': datatype {datatype!r}, model '{config.name}' expects {spec.datatype}"
        )
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidRequest(f"input '{name}': 'shape' must be a list of non-negative ints")
    check_shape(config, spec, shape)
    try:
        array = read()
    except TensorError as e:
        raise InvalidRequest(str(e)) from None
    check_range(spec, array)
    return array


def check_shape(config: ModelConfig, spec: TensorSpec, shape: list[int]) -> None:
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


def check_range(spec: TensorSpec, array: np.ndarray) -> None:
    if spec.value_range is None or not array.size:
        return
    low, high = spec.value_range
    if not (array.min() >= low and array.max() <= high):  # NaN is in no range
        raise InvalidRequest(
            f"input '{spec.name}': values must be in [{low:g}, {high:g}], got "
            f"[{array.min()}, {array.max()}]"
        )


def check_inputs(config: ModelConfig, inputs: dict[str, np.ndarray]) -> int:
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


def read_outputs(
    config: ModelConfig, asked: list[tuple[str, dict]] | None, binary_default: bool
) -> tuple[list[str], dict[str, bool], dict[str, int]]:
    """The requested outputs (all declared ones when none is named), each one's binary
    choice and the top k of those the classification extension ranks."""
    declared = [t.name for t in config.output]
    if not asked:
        return declared, dict.fromkeys(declared, binary_default), {}
    names, binary, classes = [], {}, {}
    for name, params in asked:
        if name not in declared:
            raise InvalidRequest(f"unknown output '{name}'; model '{config.name}' has {declared}")
        names.append(name)
        binary[name] = bool(params.get("binary_data", binary_default))
        if "classification" in params:  # Triton's classification extension
            classes[name] = top_k(params["classification"], name)
    return names, binary, classes


def shm_outputs(shm: Shm, asked: list[tuple[str, dict]] | None, classes: dict) -> dict:
    """The outputs asked into shared memory, each one's placement checked now."""
    placed = {}
    for name, params in asked or ():
        if "shared_memory_region" not in params:
            continue
        where = f"output '{name}'"
        if name in classes:
            raise InvalidRequest(f"{where}: a classification output cannot go to shared memory")
        placed[name] = _shm(shm, where).place(params, where)
    return placed


def shm_input(
    shm: Shm, params: dict, name: str, datatype: str, shape: list[int]
) -> np.ndarray | None:
    """An input whose parameters place it in a shared-memory region, read from there
    (None: the input's data is in the request)."""
    if "shared_memory_region" not in params:
        return None
    where = f"input '{name}'"
    region = _shm(shm, where)
    return from_binary(name, datatype, shape, region.read(region.place(params, where), where))


def _shm(shm: Shm, where: str) -> Any:
    if shm is None:
        raise InvalidRequest(f"{where}: shared memory is not served on this path")
    return shm


def int_param(params: dict, key: str) -> int:
    value = params.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"parameter '{key}' must be a non-negative integer")
    return value


def output_datatype(name: str, array: np.ndarray) -> str:
    try:
        return "BYTES" if array.dtype == object else datatype_of(array)
    except TensorError as e:
        raise InvalidRequest(f"output '{name}': {e}") from None


# ------------------------------------------------------------------- HTTP: JSON


def parse_infer(
    config: ModelConfig, body: bytes, header_length: int | None, shm: Shm = None
) -> InferRequest:
    """An HTTP request body: JSON, or JSON and the binary tensor extension's bytes;
    inputs and outputs may name `shm`'s regions."""
    header, binary = _split_body(body, header_length)
    doc = json_object(header)
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidRequest("field 'inputs' must be a non-empty list")
    params = _params(doc, "request")
    offset = 0

    def wire_inputs() -> Iterable[WireInput]:
        for item in raw_inputs:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise InvalidRequest("each entry of 'inputs' must be an object with a 'name'")
            yield item["name"], item.get("datatype"), item.get("shape"), partial(read, item)

    def read(item: dict) -> np.ndarray:
        nonlocal offset
        name, datatype, shape = item["name"], item["datatype"], item["shape"]
        params = _params(item, f"input '{name}'")
        size = params.get("binary_data_size")
        if (shared := shm_input(shm, params, name, datatype, shape)) is not None:
            if size is not None or "data" in item:
                raise InvalidRequest(f"input '{name}': its data is in shared memory and the body")
            return shared
        if size is not None:
            if not isinstance(size, int) or size < 0:
                raise InvalidRequest(f"input '{name}': binary_data_size must be an integer")
            if offset + size > len(binary):
                raise InvalidRequest(
                    f"input '{name}': binary data truncated: binary_data_size is {size} "
                    f"but {len(binary) - offset} bytes remain"
                )
            offset += size
            return from_binary(name, datatype, shape, binary[offset - size : offset])
        if "data" in item:
            return from_json(name, datatype, shape, item["data"])
        raise InvalidRequest(f"input '{name}': needs 'data' or binary_data_size")

    def all_claimed() -> None:
        if offset != len(binary):
            raise InvalidRequest(
                f"body holds {len(binary) - offset} bytes of binary data that no input claims"
            )

    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest("field 'id' must be a string")
    return infer_request(
        config,
        wire_inputs(),
        params,
        _json_outputs(doc.get("outputs")),
        request_id,
        binary_default=bool(params.get("binary_data_output", False)),
        after_inputs=all_claimed,
        shm=shm,
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


def _json_outputs(raw: Any) -> list[tuple[str, dict]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidRequest("field 'outputs' must be a list")
    asked = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidRequest("each entry of 'outputs' must be an object with a 'name'")
        asked.append((item["name"], _params(item, f"output '{item['name']}'")))
    return asked


def encode_response(
    model: str,
    version: int,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    shm: Shm = None,
) -> tuple[bytes, int | None]:
    """The response body and, when some output is binary, the JSON header's length.
    An output placed in shared memory is written there; its entry has no data.

    JSON data holding NaN or an infinity is written `NaN`, `Infinity`, `-Infinity`, as
    Triton's writer does (rapidjson's kWriteNanAndInfFlag) and Python's json and
    tritonclient read them; orjson, strict JSON, would write null."""
    entries, blobs = [], []
    finite = True
    for name in request.outputs:
        array = outputs[name]
        entry: dict[str, Any] = {
            "name": name,
            "datatype": output_datatype(name, array),
            "shape": list(array.shape),
        }
        if name in request.shm:
            entry["parameters"] = shm_output(shm, request.shm[name], name, array)
        elif request.binary.get(name):
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


def shm_output(shm: Shm, placement: Any, name: str, array: np.ndarray) -> dict:
    """Write an output into its region; the parameters its response entry carries."""
    where = f"output '{name}'"
    blob = to_binary(array)
    _shm(shm, where).write(placement, blob, where)
    return {"shared_memory_region": placement.region, "shared_memory_byte_size": len(blob)}


# -------------------------------------------------------------- gRPC: protobuf


def parse_grpc_infer(
    config: ModelConfig,
    request: pb.ModelInferRequest,
    deadline_s: float | None,
    shm: Shm = None,
) -> InferRequest:
    """A `ModelInferRequest`. A client deadline becomes the request's queue timeout, so
    the batcher drops it unrun once the deadline passes. `raw_input_contents` holds one
    entry per input whose data is not in a shared-memory region, in input order."""
    if not request.inputs:
        raise InvalidRequest("field 'inputs' must be a non-empty list")
    raw = request.raw_input_contents
    params = [grpc_params(t.parameters) for t in request.inputs]
    shared = sum("shared_memory_region" in p for p in params)
    if raw and len(raw) != len(request.inputs) - shared:
        raise InvalidRequest(
            f"field 'raw_input_contents' has {len(raw)} entries for "
            f"{len(request.inputs) - shared} inputs not in shared memory"
        )
    wire_inputs, at = [], 0
    for tensor, tensor_params in zip(request.inputs, params, strict=True):
        shape = list(tensor.shape)
        if "shared_memory_region" in tensor_params:
            read = partial(shm_input, shm, tensor_params, tensor.name, tensor.datatype, shape)
        else:
            read = _reader(tensor, shape, raw[at] if raw else None)
            at += 1
        wire_inputs.append((tensor.name, tensor.datatype, shape, read))
    asked = request.outputs
    outputs = [(o.name, grpc_params(o.parameters)) for o in asked] if asked else None
    parsed = infer_request(
        config, wire_inputs, grpc_params(request.parameters), outputs, request.id or None, shm=shm
    )
    if deadline_s is not None:
        left = max(1, int(deadline_s * 1e6))
        parsed.timeout_us = min(parsed.timeout_us, left) if parsed.timeout_us else left
    return parsed


def _reader(
    tensor: pb.ModelInferRequest.InferInputTensor, shape: list[int], raw: bytes | None
) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        name, datatype = tensor.name, tensor.datatype
        if raw is None:
            return _from_contents(name, datatype, shape, tensor.contents)
        if tensor.HasField("contents"):
            raise InvalidRequest(
                f"input '{name}': give its data in 'contents' or in 'raw_input_contents', not both"
            )
        return from_binary(name, datatype, shape, raw)

    return read


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


def grpc_params(parameters: Any) -> dict:
    """A protobuf map of `InferParameter` as the plain values JSON parameters hold."""
    if not parameters:
        return {}
    return {
        k: getattr(v, v.WhichOneof("parameter_choice") or "bool_param")
        for k, v in parameters.items()
    }


def streams(request: pb.ModelInferRequest) -> bool:
    """An LLM streams unless its sampling_parameters say `"stream": false` (a request
    that cannot be read streams, and fails there with the error that names the field)."""
    for i, tensor in enumerate(request.inputs):
        if tensor.name != "sampling_parameters":
            continue
        if request.raw_input_contents and i < len(request.raw_input_contents):
            raw = request.raw_input_contents[i][4:]  # one BYTES element: length, then bytes
        else:
            raw = next(iter(tensor.contents.bytes_contents), b"{}")
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
            return orjson.loads(raw).get("stream", True) is not False
    return True


def encode_grpc_response(
    model: str,
    version: int,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    response: pb.ModelInferResponse | None = None,
    shm: Shm = None,
) -> pb.ModelInferResponse:
    """The response message, or `response` filled in (a stream's `infer_response`,
    which then needs no copy into its envelope). An output placed in shared memory is
    written there, with an empty raw_output_contents entry that keeps the others' index."""
    pb = grpc_messages()
    if response is None:
        response = pb.ModelInferResponse()
    response.model_name = model
    response.model_version = str(version)
    if request.id is not None:
        response.id = request.id
    for name in request.outputs:
        array = outputs[name]
        datatype = output_datatype(name, array)
        tensor = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if name in request.shm:
            placed = shm_output(shm, request.shm[name], name, array)
            tensor.parameters["shared_memory_region"].string_param = placed["shared_memory_region"]
            tensor.parameters["shared_memory_byte_size"].int64_param = placed[
                "shared_memory_byte_size"
            ]
            response.raw_output_contents.append(b"")
            continue
        response.raw_output_contents.append(to_binary(array))
    return response


# ------------------------------------------------ metadata, config, statistics


def model_metadata(version: ModelVersion, entry: ModelEntry) -> dict:
    """A model version's metadata (`GET /v2/models/{m}`, ModelMetadata): its name, the
    versions of its `entry` that serve, its platform and its tensors."""
    config = version.config

    def tensors(specs: list[TensorSpec]) -> list[dict]:
        return [
            {"name": t.name, "datatype": t.datatype, "shape": config.full_shape(t)} for t in specs
        ]

    return {
        "name": config.name,
        "versions": [str(n) for n, v in sorted(entry.versions.items()) if v.ready],
        "platform": version.platform,
        "inputs": tensors(config.input),
        "outputs": tensors(config.output),
    }


def model_stats(
    repository: Repository, model: str | None, version: str | None = None
) -> list[dict]:
    """The statistics of every batched model version (of `model`, `version` when given)."""
    if model:
        repository.entry(model)  # unknown: ModelNotFound
    stats = []
    for name, entry in sorted(repository.models.items()):
        if model and name != model:
            continue
        for number, served in sorted(entry.versions.items()):
            report = served.report()
            if report.batch is None or (version and str(number) != version):
                continue
            s = report.batch
            stats.append(
                {
                    "name": name,
                    "version": str(number),
                    "state": served.state,
                    "inference_count": s.inference_count,
                    "execution_count": s.execution_count,
                    "batch_stats": [
                        {"batch_size": size, "count": count}
                        for size, count in sorted(s.batch_sizes.items())
                    ],
                    "queue_seconds": s.queue_seconds,
                    "queue_depth": report.queued,
                    "rejected_queue_full": s.rejected_full,
                    "rejected_timeout": s.rejected_timeout,
                    "cancelled": s.cancelled,
                }
            )
    return stats


def stats_message(stats: dict) -> pb.ModelStatistics:
    """One entry of `model_stats` as Triton's ModelStatistics (times in nanoseconds)."""
    pb = grpc_messages()
    duration = pb.StatisticDuration
    failed = stats["rejected_queue_full"] + stats["rejected_timeout"] + stats["cancelled"]
    return pb.ModelStatistics(
        name=stats["name"],
        version=stats["version"],
        inference_count=stats["inference_count"],
        execution_count=stats["execution_count"],
        inference_stats=pb.InferStatistics(
            queue=duration(count=stats["inference_count"], ns=round(stats["queue_seconds"] * 1e9)),
            fail=duration(count=failed),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=b["batch_size"], compute_infer=duration(count=b["count"])
            )
            for b in stats["batch_stats"]
        ],
    )


def config_message(version: ModelVersion) -> pb.ModelConfig:
    """The model's config.toml in model_config.proto's words (times in microseconds)."""
    pb = grpc_messages()
    c = version.config
    config = pb.ModelConfig(
        name=c.name, platform=version.platform, backend=c.backend, max_batch_size=c.max_batch_size
    )
    for t in c.input:
        config.input.add(
            name=t.name,
            data_type=f"TYPE_{'STRING' if t.datatype == 'BYTES' else t.datatype}",
            dims=t.dims,
            allow_ragged_batch=t.ragged,
            optional=t.optional,
        )
    for t in c.output:
        config.output.add(
            name=t.name,
            data_type=f"TYPE_{'STRING' if t.datatype == 'BYTES' else t.datatype}",
            dims=t.dims,
            label_filename=t.labels or "",
        )
    if c.dynamic_batching is not None:
        d = c.dynamic_batching
        config.dynamic_batching.preferred_batch_size.extend(d.preferred_batch_sizes)
        config.dynamic_batching.max_queue_delay_microseconds = round(d.max_queue_delay_ms * 1000)
        config.dynamic_batching.priority_levels = d.priority_levels
        config.dynamic_batching.default_priority_level = d.default_priority_level
    for key, value in c.parameters.items():
        config.parameters[key].string_value = (
            value if isinstance(value, str) else orjson.dumps(value).decode()
        )
    return config


def grpc_messages() -> Any:
    """The v2 protobuf messages, imported on first use: a process that never speaks gRPC
    (a batch job, a test process that loads tritonclient's own copy of the same proto
    package, whose names would clash in protobuf's default pool) never loads them."""
    from bitserve.api.proto import grpc_service_pb2

    return grpc_service_pb2
