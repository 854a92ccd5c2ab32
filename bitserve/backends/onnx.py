"""The `onnx` backend: `<version>/model.onnx` run by onnxruntime.

ONNX files hold only a graph and raw tensors (protobuf, no pickle), which is why they are
the safe interchange format next to safetensors. Inputs are fed by name, so a
config's input order does not matter here; the names must match the graph's, checked
at load so that a mismatch is a load error rather than a failure on the first request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bitserve.backends.base import LoadError, Model
from bitserve.config import ModelConfig

log = logging.getLogger(__name__)

# onnxruntime's type strings and the numpy dtype each takes.
_ORT_DTYPES: dict[str, np.dtype] = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in {
        "bool": np.bool_,
        "uint8": np.uint8,
        "uint16": np.uint16,
        "uint32": np.uint32,
        "uint64": np.uint64,
        "int8": np.int8,
        "int16": np.int16,
        "int32": np.int32,
        "int64": np.int64,
        "float16": np.float16,
        "float": np.float32,
        "double": np.float64,
    }.items()
}


def providers(config: ModelConfig, device: str) -> list[Any]:
    """onnxruntime's execution providers for an instance placed on `device`: CUDA first
    when that is a GPU (and the instance group is not kind "cpu") and this onnxruntime
    build has CUDA, the CPU always (for the operators CUDA lacks). Every backend that runs
    an onnxruntime session takes them from here."""
    wants_gpu = device.startswith("cuda") and config.instance_group.kind != "cpu"
    if wants_gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        index = int(device.partition(":")[2] or 0)
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def open_session(
    path: Path, options: ort.SessionOptions, config: ModelConfig, device: str
) -> ort.InferenceSession:
    """A session on `providers(config, device)`; the log says which providers it took,
    and warns when a GPU instance runs on the CPU because this onnxruntime is the CPU
    build (`pip install 'bitserve[gpu]'` brings onnxruntime-gpu)."""
    session = ort.InferenceSession(
        str(path), sess_options=options, providers=providers(config, device)
    )
    taken = session.get_providers()
    log.info("%s: onnxruntime on %s", path, ", ".join(taken))
    gpu = device.startswith("cuda") and config.instance_group.kind != "cpu"
    if gpu and "CUDAExecutionProvider" not in taken:
        log.warning(
            "%s: placed on %s, but this onnxruntime has no CUDAExecutionProvider (the CPU "
            "build): running on the CPU; install onnxruntime-gpu (bitserve[gpu])",
            path,
            device,
        )
    return session


class OnnxModel(Model):
    platform = "onnxruntime_onnx"

    def load(self) -> None:
        path = self.require_file("model.onnx")
        options = ort.SessionOptions()
        threads = self.config.instance_group.threads
        if threads > 0:
            options.intra_op_num_threads = threads
        try:
            self.session = open_session(path, options, self.config, self.device)
        except Exception as e:
            raise LoadError(f"{path}: onnxruntime cannot load it: {type(e).__name__}: {e}") from e
        self._check_names(path)
        # Inputs whose declared dtype differs from the config's get cast before each run.
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.output_names = [spec.name for spec in self.config.output]

    def _check_names(self, path: Any) -> None:
        declared = [spec.name for spec in self.config.input]
        declared += [spec.mask for spec in self.config.input if spec.mask]
        graph_inputs = [i.name for i in self.session.get_inputs()]
        graph_outputs = [o.name for o in self.session.get_outputs()]
        problems = []
        if sorted(declared) != sorted(graph_inputs):
            problems.append(f"inputs {graph_inputs} (the config declares {declared})")
        missing = [s.name for s in self.config.output if s.name not in graph_outputs]
        if missing:
            problems.append(f"outputs {graph_outputs} (the config declares {missing} too)")
        if problems:
            raise LoadError(f"{path}: the graph has {' and '.join(problems)}")

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        missing = [name for name in self.input_types if name not in inputs]
        if missing:
            raise ValueError(f"{self.config.name}: inputs {missing} are missing")
        feed = {name: _cast(inputs[name], kind) for name, kind in self.input_types.items()}
        values = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, values, strict=True))


def _cast(array: np.ndarray, kind: str) -> np.ndarray:
    """`array` in the element type the graph declares (BYTES become str for tensor(string))."""
    if kind == "tensor(string)":
        if array.dtype == object:
            return np.vectorize(_text, otypes=[object])(array)
        return array
    dtype = _ORT_DTYPES.get(kind)
    if dtype is None or array.dtype == dtype:
        return array
    return array.astype(dtype)


def _text(item: object) -> str:
    return item.decode() if isinstance(item, bytes) else str(item)


BACKEND = OnnxModel
