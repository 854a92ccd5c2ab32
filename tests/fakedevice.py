"""A pretend GPU on this CPU-only torch: runs GPU code paths and catches device mix-ups.

    with FakeCuda() as gpu:               # torch.cuda.is_available() is True inside
        model = model.to("cuda")          # parameters are DeviceTensors on cuda:0
        y = model(x.to("cuda"))           # real arithmetic, on the CPU underneath
        logits.index_select(0, cpu_index) # DeviceMismatch, as CUDA raises
    gpu.ops, gpu.calls, gpu.host_reads    # calls on device tensors; the syncs a GPU pays

A tensor created on "cuda" (`device=` of any factory) or moved there (`.to`, `.cuda`,
`Module.to`) is a `DeviceTensor`: a wrapper that reports `device == cuda:N` (so code
that reads `.device` or `.is_cuda` takes its GPU branch) around a plain CPU tensor that
holds the values (so results can be held to a CPU reference). A TorchFunctionMode sees
every torch call, unwraps, runs it on the CPU and wraps the result, after checking what
CUDA checks:
- every tensor of an op is on one device. The exceptions are CUDA's: a 0-dim CPU tensor
  (a scalar) may join a device op; copies (`copy_`, `.to`, `.cpu`) cross devices; and
  indexing (`x[idx]`, `x[idx] = v`) accepts CPU index tensors (CUDA moves them over);
- two pretend devices (cuda:0 and cuda:1) never mix;
- `.numpy()` and `np.asarray` of a device tensor raise, as on CUDA.
A mix raises `DeviceMismatch` (a RuntimeError, the error CUDA raises, naming the op).

Why not the stock proxies: `FakeTensorMode` fails on slicing and tensor indexing on a
CPU-only torch (C++ device guards for cuda), and the `meta` device lets a CPU index into
`index_select`. This mode works above the dispatcher, so neither arises.

Known gaps (a real GPU decides those): ops CUDA rejects for a 0-dim CPU tensor (e.g.
`index_select`'s index) pass here; TorchScript modules and custom C++ ops run below
torch functions and are not seen; `torch.Generator(device="cuda")` cannot be made on
a CPU-only torch; kernels (Triton) are not emulated; memory is not modelled.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

GIB = 1 << 30


class DeviceMismatch(RuntimeError):
    """What CUDA raises: an op given tensors on two devices."""


class DeviceTensor(torch.Tensor):
    """A tensor on a pretend device: its values live in `elem`, a CPU tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=device,
        )
        t.elem = elem
        return t

    # the mode sees every call; outside it a DeviceTensor does nothing
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a pretend-cuda tensor used outside FakeCuda")


_Generator = torch.Generator


class FakeGenerator(_Generator):
    """`torch.Generator(device="cuda")` inside FakeCuda: a CPU generator (the same
    stream as a CPU one of the same seed) that reports the pretend device, so a draw
    for a device tensor from a CPU generator (or the reverse) raises, as on CUDA."""

    def __new__(cls, device: Any = "cpu"):
        g = _Generator.__new__(cls, "cpu")
        g.fake_device = _cuda(device) if _is_cuda(device) else torch.device(device)
        return g

    def __init__(self, device: Any = "cpu"):
        pass

    @property
    def device(self) -> torch.device:
        return self.fake_device


def on_device(t: Any) -> bool:
    return isinstance(t, DeviceTensor)


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor that holds a DeviceTensor's values (itself for a CPU tensor)."""
    return t.elem if isinstance(t, DeviceTensor) else t


# tensor attributes read from the wrapper (its metadata is the real one); the rest
# (data, T, mT, grad, ...) come from the values, wrapped again
_METADATA = {
    "device",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "shape",
    "dtype",
    "layout",
    "ndim",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "is_nested",
    "names",
    "itemsize",
    "nbytes",
    "is_inference",
}
# reading values on the host: what a GPU pays a sync for
# metadata queries: no kernel on a GPU, not counted in `ops`
_METADATA_CALLS = {
    "size",
    "dim",
    "ndimension",
    "stride",
    "numel",
    "nelement",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "element_size",
    "storage_offset",
    "data_ptr",
    "get_device",
    "is_pinned",
    "__len__",
    "__hash__",
}
_HOST_READS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "argwhere",
    "unique",
    "unique_consecutive",
    "masked_select",
    "equal",
}
_PASS_THROUGH = {"_parse_to", "__repr__", "__format__", "__str__"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put", "_index_put_impl_"}


def _masks(key: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(key)[0])


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # torch reads a bare int as a CUDA index
    return torch.device(device).type == "cuda"


def _cuda(device: Any) -> torch.device:
    index = device if isinstance(device, int) else torch.device(device).index
    return torch.device("cuda", index or 0)


class FakeEvent:
    """`torch.cuda.Event`: every op already ran when it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


class FakeCuda(TorchFunctionMode):
    """The pretend GPU(s): `count` devices of `total` bytes, `free` of them free.

    Inside, `torch.cuda.is_available()` is True and `device_count`, `mem_get_info`,
    `get_device_properties`, `set_device`, `synchronize`, `memory_allocated`,
    `empty_cache` answer for the pretend devices, and `torch.Generator(device="cuda")`
    is a `FakeGenerator`; leaving puts those (and torch's TF32 flags) back. `ops`
    counts torch calls that touched a device tensor (metadata queries such as `size()`
    aside; views included), `calls` the same by name; `host_reads` lists (in order) the
    calls that read device values on the host (`.item()`, `.tolist()`, `.cpu()`,
    `bool(t)`, `nonzero`, ...)."""

    def __init__(self, count: int = 1, total: int = 80 * GIB, free: int | None = None):
        super().__init__()
        self._thread_run = threading.Thread.run
        self.count, self.total = count, total
        self.free = total - GIB // 2 if free is None else free
        self.ops = 0
        self.calls: Counter[str] = Counter()  # the same calls by name
        self.host_reads: list[str] = []
        self.current = 0
        self._saved: dict[str, Any] = {}

    # -- torch.cuda ---------------------------------------------------------------------
    def _cuda_functions(self) -> dict[str, Any]:
        props = SimpleNamespace(
            name="FakeCuda", total_memory=self.total, major=9, minor=0, multi_processor_count=132
        )
        return {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.current,
            "set_device": self._set_device,
            "synchronize": lambda device=None: None,
            "mem_get_info": lambda device=None: (self.free, self.total),
            "get_device_properties": lambda device=None: props,
            "get_device_name": lambda device=None: props.name,
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 0,
            "memory_reserved": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
            "empty_cache": lambda: None,
            "is_bf16_supported": lambda *a, **k: True,
            "Event": FakeEvent,  # the work it would mark is done at once on the CPU
        }

    def _set_device(self, device: Any) -> None:
        self.current = _cuda(device).index

    def __enter__(self):
        for name, fn in self._cuda_functions().items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, fn)
        torch.Generator = FakeGenerator
        self._tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        threading.Thread.run = self._run_in_mode(self._thread_run)
        return super().__enter__()

    def _run_in_mode(self, run):
        """Threads started inside see the pretend GPU too (a torch function mode is
        per thread): an engine's step loop, a server's worker threads."""
        mode = self

        def run_in_mode(thread):
            TorchFunctionMode.__enter__(mode)
            try:
                run(thread)
            finally:
                TorchFunctionMode.__exit__(mode, None, None, None)

        return run_in_mode

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)
        self._saved.clear()
        torch.Generator = _Generator
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32
        threading.Thread.run = self._thread_run
        return super().__exit__(*exc)

    # -- every torch call ---------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute
            return self._attribute(func, args)
        if name == "_has_compatible_shallow_copy_type":  # so Module.to makes new Parameters
            return on_device(args[0]) == on_device(args[1]) and func(*args)
        if name in _PASS_THROUGH:
            if name == "__repr__" and on_device(args[0]):
                return f"{host(args[0])!r} (on {args[0].device})"
            return func(*args, **kwargs)
        special = getattr(self, "_" + name.strip("_"), None) if name in _SPECIAL else None
        flat, _ = tree_flatten((args, kwargs))
        devices = {t.device for t in flat if on_device(t)}
        if devices and name not in _METADATA_CALLS:
            self.ops += 1
            self.calls[name] += 1
        if special is not None:
            return special(func, args, kwargs, devices)
        target = None
        if _is_cuda(kwargs.get("device")):  # a factory (or new_*) asked for cuda
            target = _cuda(kwargs["device"])
            kwargs["device"] = "cpu"
            devices = devices | {target}
        kwargs.pop("pin_memory", None)  # a CPU-only torch cannot pin
        self._check(name, args, kwargs, flat, devices)
        if devices and (name in _HOST_READS or (name == "__getitem__" and _masks(args[1]))):
            self.host_reads.append(name)  # (a boolean mask's count is read on the host)
        out = func(*tree_map(host, args), **tree_map(host, kwargs))
        if not devices:
            return out
        (device,) = devices
        return self._wrap(out, device, flat)

    def _check(self, name, args, kwargs, flat, devices) -> None:
        for g in flat:
            if isinstance(g, _Generator) and devices and g.device not in devices:
                (device,) = devices
                raise DeviceMismatch(
                    f"{name}: Expected a '{device.type}' device type for generator but "
                    f"found '{g.device.type}'"
                )
        if len(devices) > 1:
            raise DeviceMismatch(
                f"{name}: Expected all tensors to be on the same device, but found at "
                f"least two devices, {' and '.join(sorted(map(str, devices)))}!"
            )
        if not devices:
            return
        if name in _INDEXING:  # CPU index tensors are moved over; values must be there
            values = args[2] if name == "__setitem__" else (args[2:3] or [None])[0]
            key_has_tensor = any(isinstance(t, torch.Tensor) for t in tree_flatten(args[1])[0])
            flat = [values] if key_has_tensor or name != "__setitem__" else []
        host_tensors = [
            t
            for t in flat
            if isinstance(t, torch.Tensor)
            and not on_device(t)
            and t.device.type == "cpu"
            and t.dim() > 0
        ]
        if host_tensors:
            (device,) = devices
            raise DeviceMismatch(
                f"{name}: Expected all tensors to be on the same device, but found at "
                f"least two devices, {device} and cpu! (a cpu tensor of shape "
                f"{list(host_tensors[0].shape)})"
            )

    def _wrap(self, out, device, inputs):
        """The result on `device`; an op that returned its input (in place) returns the
        input's wrapper, so `x.add_(1) is x` holds as on a GPU."""
        wrappers = {id(host(t)): t for t in inputs if on_device(t)}

        def wrap(o):
            if not isinstance(o, torch.Tensor) or on_device(o):
                return o
            same = wrappers.get(id(o))
            return DeviceTensor(o, device) if same is None else same

        return tree_map(wrap, out)

    def _attribute(self, func, args):
        t = args[0]
        attr = func.__self__.__name__
        if not on_device(t) or attr in _METADATA:
            return func(t)
        return self._wrap(func(t.elem), t.device, [t])

    # -- the calls that move, read or report a device ----------------------------------
    def _to(self, func, args, kwargs, devices):
        t = args[0]
        parsed = torch._C._nn._parse_to(*args[1:], **kwargs)
        device, dtype = parsed[0], parsed[1] or t.dtype
        copy = bool(kwargs.get("copy"))
        source = t.device if on_device(t) else None
        if device is None:
            target = source
        else:
            target = _cuda(device) if _is_cuda(device) else torch.device(device)
            if target.type == "cuda" and target.index is None:
                target = torch.device("cuda", self.current)
        if target is None or target.type != "cuda":  # to the host (or stays there)
            if source is not None:
                self.host_reads.append("to(cpu)")
                return host(t).to(dtype=dtype, copy=True)
            return func(*args, **kwargs)
        if source == target and dtype == t.dtype and not copy:
            return t
        values = host(t).to(dtype=dtype, copy=True)
        return DeviceTensor(values, target)

    def _cuda(self, func, args, kwargs, devices):
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return self._to(None, (args[0], _cuda(self.current if device is None else device)), {}, 0)

    def _cpu(self, func, args, kwargs, devices):
        t = args[0]
        if not on_device(t):
            return t
        self.host_reads.append("cpu")
        return t.elem.clone()

    def _copy(self, func, args, kwargs, devices):
        dst, src = args[0], args[1]
        if on_device(src) and not on_device(dst):
            self.host_reads.append("copy_(to cpu)")
        host(dst).copy_(host(src))
        return dst

    def _numpy(self, func, args, kwargs, devices):
        if devices:
            raise TypeError(
                f"can't convert {args[0].device} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        return func(*args, **kwargs)

    _array = _numpy

    def _get_device(self, func, args, kwargs, devices):
        return args[0].device.index if on_device(args[0]) else func(*args, **kwargs)

    def _pin_memory(self, func, args, kwargs, devices):
        return args[0].clone()  # pinned memory is host memory (a CPU-only torch cannot pin)

    def _is_pinned(self, func, args, kwargs, devices):
        return False


_SPECIAL = {
    "to",
    "cuda",
    "cpu",
    "copy_",
    "numpy",
    "__array__",
    "get_device",
    "pin_memory",
    "is_pinned",
}


def assert_on(device: str, *tensors: torch.Tensor) -> None:
    """Each tensor is on `device` ("cuda:0", "cpu")."""
    for t in tensors:
        assert str(t.device) == device, f"a tensor on {t.device}, expected {device}"


__all__ = ["DeviceMismatch", "DeviceTensor", "FakeCuda", "assert_on", "host", "on_device"]
