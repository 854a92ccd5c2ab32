"""The `torch` backend: a `torch.export` program (`model.pt2`) or TorchScript (`model.pt`).

Both formats carry the graph with the weights, so serving needs no Python model code.
`model.pt2` is preferred when both are present: it is the format torch maintains.

Never unpickle an untrusted file. `torch.export.load` (torch 2.13) reads raw tensor bytes
for weights, but it would still run a pickle in several places; `_check_pt2` refuses an
archive that takes any of them, before torch sees it:

- a weight or constant whose payload config says `use_pickle` (read with
  `torch.load(weights_only=False)`), a legacy `data/weights/<model>.pt` state dict and
  the pre-2.8 archive layout (both tried with `weights_only=True`, then silently retried
  with `weights_only=False`), `opaque_obj_*` constants (plain `pickle.loads`) and
  `custom_obj_*` constants (TorchScript objects);
- `data/sample_inputs/*.pt`, which torch loads with `weights_only=True` but retries
  unrestricted when that fails: we load it with `weights_only=True` first and refuse
  the archive if that fails;
- `data/aotinductor/` (a compiled shared library that `torch.export.load` dlopens).

What remains is JSON and raw tensor bytes. The graph itself may only call torch
operators: torch's own verifier refuses any other callable when the program is built.

On the CPU, a torch.export program's fp32 `aten.linear` layers whose weights are constants
run bitserve's packed GEMM (`_pack_linears`): the weights are packed once at load, where
torch's BLAS packs them again on every call. At the 8-64 rows a dynamic batch holds, the
mlp's layers run 1.2-2.8x faster (`python -m bench.kernels --shapes mlp`), the same at
one row. BITSERVE_NO_KERNELS=1 keeps torch's own.

TorchScript (`torch.jit.load`) uses TorchScript's own unpickler, which builds tensors
and TorchScript types only and resolves no Python globals; its code is TorchScript IR,
not Python. It is accepted as the older, still common export format.
"""

from __future__ import annotations

import io
import json
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bitserve import kernels
from bitserve.backends.base import LoadError, Model, set_threads
from bitserve.tensors import DATATYPES

_BF16 = DATATYPES["BF16"]

# Entries a plain `torch.export.save` archive holds (paths below the archive's root folder).
_PT2_FIXED = {"archive_format", "archive_version", "byteorder"}
_PT2_PREFIXES = ("models/", "extra/", ".data/", "data/sample_inputs/")
# torch.export's deserializer is process-global (`_CURRENT_DESERIALIZER`): two versions
# loading on two threads at once fail with "already set". Only torch's loads wait here.
_TORCH_LOAD = threading.Lock()


class TorchModel(Model):
    platform = "pytorch_libtorch"
    packed_linears = 0  # how many linear layers run bitserve's packed GEMM

    def load(self) -> None:
        path = self.require_file("model.pt2", "model.pt")
        for spec in self.config.input:
            if spec.datatype == "BYTES":
                raise LoadError(
                    f"{path}: input {spec.name!r} is BYTES; torch takes numeric tensors"
                )
        set_threads(self.config.instance_group.threads)
        device = torch.device(self.device)
        try:
            if path.suffix == ".pt2":
                self.platform = "torch_export"
                _check_pt2(path)
                with _TORCH_LOAD:
                    program = torch.export.load(path)
                    self.module = program.module().to(device)
                lib = kernels.get() if device.type == "cpu" else None
                if lib is not None and lib.lib.bs_packed_vectorised():
                    lib.lib.bs_set_threads(torch.get_num_threads())
                    self.packed_linears = _pack_linears(self.module, lib)
            else:
                with _TORCH_LOAD:
                    self.module = torch.jit.load(str(path), map_location=device)
                self.module.eval()
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"{path}: cannot load: {type(e).__name__}: {e}") from e
        self.path = path
        self.torch_device = device
        # Positional argument order: each input, then the mask the batcher adds for it.
        self.arg_names: list[tuple[str, bool]] = []
        for spec in self.config.input:
            self.arg_names.append((spec.name, spec.optional))
            if spec.mask:
                self.arg_names.append((spec.mask, False))

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        args = []
        for name, optional in self.arg_names:
            array = inputs.get(name)
            if array is None:
                if not optional:
                    raise ValueError(f"{self.path}: input {name!r} is missing")
                args.append(None)
            else:
                args.append(_to_tensor(array).to(self.torch_device, non_blocking=True))
        with torch.inference_mode():
            result = self.module(*args)
        return self._outputs(result)

    def _outputs(self, result: Any) -> dict[str, Any]:
        names = [spec.name for spec in self.config.output]
        if isinstance(result, dict):
            missing = [n for n in names if n not in result]
            if missing:
                raise ValueError(f"{self.path}: the model returned no {missing}")
            return {n: result[n] for n in names}
        values = list(result) if isinstance(result, tuple | list) else [result]
        if len(values) != len(names):
            raise ValueError(
                f"{self.path}: the model returned {len(values)} outputs, the config "
                f"declares {len(names)} ({names})"
            )
        return dict(zip(names, values, strict=True))


def _pack_linears(module: torch.fx.GraphModule, lib: kernels.Kernels) -> int:
    """Rewrite, in place, each `aten.linear` of an fp32 input whose weight is a constant
    fp32 [N, K] (N a multiple of 16) and whose bias is a constant or absent, into
    `lib.linear_packed` over the weight packed once, here. Returns how many.

    A weight the graph no longer reads is dropped, so the packed copy replaces it; one
    still read elsewhere (a tied embedding) stays. Sums run in another order than the
    BLAS's, so results differ from torch's in the last bits, as between two BLAS builds.
    """
    graph = module.graph
    linear = _packed_linear(lib)
    packed: dict[str, torch.fx.Node] = {}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        x, w, *rest = node.args
        b = rest[0] if rest else node.kwargs.get("bias")
        if not _packable(module, x, w, b):
            continue
        if w.target not in packed:
            name = f"_bitserve_packed_{len(packed)}"
            module.register_buffer(name, lib.pack(_attr(module, w.target).contiguous()))
            with graph.inserting_before(node):
                packed[w.target] = graph.get_attr(name)
        with graph.inserting_before(node):
            new = graph.call_function(linear, (x, packed[w.target], b))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users and node.target in packed:
            owner, _, leaf = node.target.rpartition(".")
            delattr(module.get_submodule(owner), leaf)
            graph.erase_node(node)
    if count:
        graph.lint()
        module.recompile()
    return count


def _packable(module: torch.nn.Module, x: Any, w: Any, b: Any) -> bool:
    if not _fp32_cpu(getattr(x, "meta", {}).get("val")) or getattr(w, "op", None) != "get_attr":
        return False
    weight = _attr(module, w.target)
    if not _fp32_cpu(weight) or weight.dim() != 2 or weight.shape[0] % 16 or not weight.numel():
        return False
    if b is None:
        return True
    if getattr(b, "op", None) != "get_attr":
        return False
    bias = _attr(module, b.target)
    return _fp32_cpu(bias) and bias.shape == (weight.shape[0],) and bias.is_contiguous()


def _fp32_cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"


def _attr(module: torch.nn.Module, target: str) -> Any:
    owner, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _packed_linear(lib: kernels.Kernels):
    def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
        """aten.linear on `packed` (bs_pack's [N, K]); x [..., K] fp32."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return lib.linear_packed(rows, packed, bias).view(*x.shape[:-1], packed.shape[0])

    return packed_linear


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing the array's memory (copying only a layout torch cannot view).

    Arrays decoded from the binary protocol are read-only views of the request body;
    torch warns once per process about those. A torch.export program is functional and
    does not write to its inputs.
    """
    if array.dtype == _BF16:
        return _to_tensor(array.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(array)
    except ValueError:  # negative strides (a reversed view) or a non-native byte order
        return torch.from_numpy(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")))


def _check_pt2(path: Path) -> None:
    """Refuse a .pt2 archive whose loading would run a pickle or native code (see above)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise LoadError(f"{path}: not a torch.export archive: {e}") from e
    with archive:
        entries = {name.split("/", 1)[1]: name for name in archive.namelist() if "/" in name}
        if "archive_version" not in entries:
            raise LoadError(
                f"{path}: an old torch.export layout, which torch may read with an "
                "unrestricted pickle; re-export it with torch.export.save from torch >= 2.8"
            )
        for entry, name in entries.items():
            if entry in _PT2_FIXED or entry.endswith("/") or entry.startswith(_PT2_PREFIXES):
                pass
            elif entry.startswith(("data/weights/", "data/constants/")):
                _check_payload(path, archive, entry, name)
            else:
                raise LoadError(f"{path}: refusing archive entry {entry!r}: it is not plain data")
            if entry.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception as e:
                    raise LoadError(
                        f"{path}: {entry} needs an unrestricted pickle; refusing it ({e})"
                    ) from None


def _check_payload(path: Path, archive: zipfile.ZipFile, entry: str, name: str) -> None:
    """A weights/constants entry must be raw tensor bytes or a config that says so."""
    folder, file = entry.rsplit("/", 1)
    if not file.endswith("_config.json"):
        if file.startswith(("weight_", "tensor_")) and "." not in file:
            return
        raise LoadError(f"{path}: refusing {entry}: not a raw tensor payload (a pickle?)")
    try:
        config = json.loads(archive.read(name))["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise LoadError(f"{path}: {entry} is not a payload config: {e}") from None
    for fqn, meta in config.items():
        if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(
            ("weight_", "tensor_")
        ):
            raise LoadError(
                f"{path}: {folder} entry {fqn!r} is stored as a pickle "
                f"({meta.get('path_name')}); refusing to unpickle it"
            )


BACKEND = TorchModel
