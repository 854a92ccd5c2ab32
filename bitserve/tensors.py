"""v2 datatypes and their numpy form; the raw layout of the binary tensor extension.

Every v2 datatype maps to one numpy dtype. BYTES tensors are numpy object arrays of
`bytes`; BF16 uses ml_dtypes' `bfloat16`, a real numpy dtype, so a BF16 tensor is
carried without conversion. In the binary extension a tensor is its little-endian,
row-major bytes; a BYTES element is a 4-byte little-endian length then the bytes.
"""

from __future__ import annotations

import struct
import sys

import ml_dtypes
import numpy as np

DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_BY_DTYPE = {v: k for k, v in DATATYPES.items()}
_LITTLE = sys.byteorder == "little"
# each numeric datatype as the wire lays it out: little-endian
_WIRE = {k: v.newbyteorder("<") for k, v in DATATYPES.items() if k != "BYTES"}


class TensorError(ValueError):
    """Tensor data that does not match its declared datatype or shape."""


def datatype_of(array: np.ndarray) -> str:
    if array.dtype.kind in "SU":
        return "BYTES"
    try:
        return _BY_DTYPE[array.dtype]
    except KeyError:
        raise TensorError(f"numpy dtype {array.dtype} has no v2 datatype") from None


def num_elements(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def from_json(name: str, datatype: str, shape: list[int], data: object) -> np.ndarray:
    """Build the array for one JSON input; `data` may be nested or flat row-major."""
    count = num_elements(shape)
    if datatype == "BYTES":
        flat = _flatten(data) if isinstance(data, list) else [data]
        if len(flat) != count:
            raise TensorError(
                f"input '{name}': shape {shape} needs {count} elements, data has {len(flat)}"
            )
        out = np.empty(count, dtype=object)
        for i, item in enumerate(flat):
            if isinstance(item, str):
                out[i] = item.encode()
            elif isinstance(item, bytes):
                out[i] = item
            else:
                raise TensorError(f"input '{name}': BYTES elements must be strings")
        return out.reshape(shape)
    dtype = DATATYPES[datatype]
    try:
        if datatype == "BF16":
            array = np.asarray(data, dtype=np.float32).astype(dtype)
        else:
            array = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        raise TensorError(
            f"input '{name}': data is not a (nested) list of {datatype} values"
        ) from None
    if array.dtype == object or array.size != count:
        raise TensorError(
            f"input '{name}': shape {shape} needs {count} elements, data has "
            f"{array.size if array.dtype != object else 'a ragged list of'} elements"
        )
    if datatype != "BOOL" and not isinstance(data, list | int | float):
        raise TensorError(f"input '{name}': data must be a list of numbers")
    return array.reshape(shape)


def _flatten(data: list) -> list:
    out: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def to_json(array: np.ndarray) -> object:
    """Flat row-major data for a JSON output (orjson serialises numpy arrays natively)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return [_as_text(x) for x in array.reshape(-1).tolist()]
    if array.dtype == DATATYPES["BF16"] or array.dtype == np.float16:
        return array.astype(np.float32).reshape(-1)
    return np.ascontiguousarray(array).reshape(-1)


def _as_text(item: object) -> str:
    if isinstance(item, bytes):
        try:
            return item.decode()
        except UnicodeDecodeError:
            raise TensorError(
                "a BYTES output is not UTF-8; request it with binary_data=true"
            ) from None
    return str(item)


def from_binary(name: str, datatype: str, shape: list[int], raw: bytes | memoryview) -> np.ndarray:
    """Decode one tensor of the binary extension."""
    count = num_elements(shape)
    if datatype == "BYTES":
        items, offset, view = [], 0, memoryview(raw)
        while offset < len(view):
            if offset + 4 > len(view):
                raise TensorError(f"input '{name}': truncated BYTES length prefix")
            (length,) = struct.unpack_from("<I", view, offset)
            offset += 4
            if offset + length > len(view):
                raise TensorError(f"input '{name}': BYTES element overruns binary_data_size")
            items.append(bytes(view[offset : offset + length]))
            offset += length
        if len(items) != count:
            raise TensorError(
                f"input '{name}': shape {shape} needs {count} elements, binary data has "
                f"{len(items)}"
            )
        out = np.empty(count, dtype=object)
        out[:] = items
        return out.reshape(shape)
    dtype = _WIRE[datatype]
    if len(raw) != count * dtype.itemsize:
        raise TensorError(
            f"input '{name}': shape {shape} of {datatype} needs {count * dtype.itemsize} "
            f"bytes, binary_data_size gives {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def to_binary(array: np.ndarray) -> bytes:
    """Raw bytes of one output for the binary extension."""
    if array.dtype == object or array.dtype.kind in "SU":
        parts = []
        for item in array.reshape(-1).tolist():
            b = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(b)))
            parts.append(b)
        return b"".join(parts)
    if array.dtype.byteorder == "<" or (array.dtype.byteorder in "=|" and _LITTLE):
        return array.tobytes()  # row-major bytes, whatever the strides
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def coerce(array: object, datatype: str) -> np.ndarray:
    """Turn a backend's output (numpy, torch, list) into an array of `datatype`."""
    if hasattr(array, "detach"):  # a torch tensor, without importing torch here
        tensor = array.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            array = tensor.view(dtype=_torch_int16()).numpy().view(DATATYPES["BF16"])
        else:
            array = tensor.numpy()
    if datatype == "BYTES":
        array = np.asarray(array, dtype=object)
        return array
    array = np.asarray(array)
    dtype = DATATYPES[datatype]
    return array if array.dtype == dtype else array.astype(dtype)


def _torch_int16():
    import torch

    return torch.int16


def allow_tf32(device: str) -> None:
    """On cuda, fp32 matmuls and convolutions may use TF32 tensor cores (torch's default
    for matmuls is full fp32, at a fraction of the tensor cores' rate); a process that
    runs only on the CPU is untouched."""
    if str(device).startswith("cuda"):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
