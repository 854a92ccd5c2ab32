"""A linear layer over llama.cpp's blocks: GGUF weights served in their own format.

`GgmlLinear` holds the bytes a GGUF file stores for a weight matrix (Q4_0, Q5_0, Q8_0,
Q4_K, Q5_K, Q6_K blocks; F32/F16/BF16 rows too), one `part` per source tensor, its rows
in output order: a fused qkv_proj of a Q4_K_M file is a Q4_K q, a Q4_K k and a Q6_K v.
The C kernels (bitserve/kernels/csrc/ggml.c, `Weight` kind 4) dequantize blocks on the
fly and meet fp32 activations, so the layer computes x @ W.T for W exactly as llama.cpp
dequantizes it, up to fp32 summation order. Nothing is re-quantized.

Activations (`activations`, the model parameter `gguf_activations`):
  - "int8" (the default, llama.cpp's own CPU scheme): x rounded to int8 per 32 columns
    meets the same codes, repacked once when the kernels attach into 16-row tiles
    (`bs_ggml_a8_pack`), in VNNI dot products; the file's bytes of those parts are then
    dropped (the tiles hold the codes: 4 bits a weight for Q4_0/Q4_K, 8 for the others,
    plus an fp32 scale and offset per 32 columns, per 16 for Q6_K). Every row count runs
    on the tiles, batch-1 decode included. x's rounding is the cost (tinylm perplexity:
    Q4_K_M 25.0067 -> 25.0076, llama.cpp's own figure).
  - "fp32": the file's blocks dequantized on the fly against fp32 x, W exactly as
    llama.cpp dequantizes it up to fp32 summation order (the parity path).
F32/F16/BF16 parts always take the fp32 path.

Invariants: each part is uint8 [rows, row_bytes], row_bytes = `bs_ggml_row_bytes(type,
in_features)`, until int8 tiles replace it (then [rows, 0]); the parts' rows add up to
out_features; parts and tiles never change once the C view is built (it points into
them). Without the C kernels (no compiler, a GPU) the layer dequantizes once (gguf-py's
own dequantizer, or the tiles read back) and runs fp32 `F.linear`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels as c
from bitserve.llm.quant.linear import I8_FUSE_ROWS

TYPES = {  # ggml type ids (gguf.GGMLQuantizationType) the kernels read
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q5_0": 6,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "BF16": 30,
}
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q5_0": (32, 22)}
BLOCKS |= {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
FUSE_ROWS = 256  # the C decode layer takes up to this many rows (panels above 4 rows)
ACTIVATIONS = ("int8", "fp32")  # what x meets the block-format weights as


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of k weights of type `kind` (k a whole number of its blocks)."""
    elems, size = BLOCKS[kind]
    if k % elems:
        raise ValueError(f"{kind} rows of {k} weights are not whole blocks of {elems}")
    return k // elems * size


class GgmlLinear(nn.Module):
    """y = x @ W.T + bias, W the concatenation of `parts` (type name, raw uint8 rows)."""

    def __init__(
        self,
        in_features: int,
        parts: list[tuple[str, torch.Tensor]],
        bias=None,
        activations: str = "int8",
    ):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"gguf_activations must be 'int8' or 'fp32', got {activations!r}")
        self.activations = activations
        self.in_features = in_features
        self.types = [kind for kind, _ in parts]
        for i, (kind, data) in enumerate(parts):
            if data.dtype is not torch.uint8 or data.shape[1] != row_bytes(kind, in_features):
                raise ValueError(
                    f"part {i}: {kind} rows of {in_features} weights, got {data.shape}"
                )
            self.register_buffer(f"part{i}", data.contiguous(), persistent=False)
        self.out_features = sum(data.shape[0] for _, data in parts)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.c_weight = self.fallback_weight = None
        self.tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}  # part -> a8

    def extra_repr(self) -> str:
        types = "+".join(self.types)
        return (
            f"in={self.in_features}, out={self.out_features}, types={types}, x={self.activations}"
        )

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        return [(kind, getattr(self, f"part{i}")) for i, kind in enumerate(self.types)]

    _kernels: c.Kernels | None = None

    @property
    def kernels(self) -> c.Kernels | None:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: c.Kernels | None) -> None:
        """Set once at load (kernels.attach): the C view, or the torch fallback's weight."""
        self._kernels = kernels
        if kernels is not None and self.activations == "int8" and self.part0.is_cpu:
            self.pack_tiles()
        self.c_weight = self.c_view(bias=True) if kernels is not None else None

    def c_view(self, lora=None, bias: bool = True):
        """The `Weight` (kind 4) the C kernels read; None without the kernels. Its parts
        array is kept on the module, as long as the view may be read."""
        if c.get() is None or not self.part0.is_cpu:
            return None
        ffi = c.ffi()
        if getattr(self, "_c_parts", None) is None:  # once: every view points to it
            parts = []
            for i, (kind, data) in enumerate(self.parts()):
                part = {"type": TYPES[kind], "rows": self.rows(i)}
                part["data"] = c.ptr(data if data.numel() else None, "void *")
                if i in self.tiles:
                    tiles, sz, group, bits = self.tiles[i]
                    part |= {"tiles": c.ptr(tiles, "uint8_t *"), "sz": c.ptr(sz)}
                    part |= {"group": group, "bits": bits}
                parts.append(part)
            self._c_parts = ffi.new("GgmlPart[]", parts)
        fields = {"kind": 4, "N": self.out_features, "K": self.in_features}
        fields |= {"parts": self._c_parts, "nparts": len(self.types)}
        fields["bias"] = c.ptr(self.bias if bias else None)
        if lora is not None:
            a, bt, slots = lora
            fields |= {
                "lora_a": c.ptr(a),
                "lora_bt": c.ptr(bt),
                "lora_slots": c.ptr(slots, "int *"),
            }
            fields |= {"lora_S": a.shape[0], "lora_W": a.shape[1]}
        return ffi.new("Weight *", fields)

    @property
    def fuse_rows(self) -> int:
        """Up to how many rows the C decode layer takes this layer: with every part on
        int8 tiles any number (a prompt's in chunks of FUSED_CHUNK), as bitserve's own
        int8: past 256 rows the torch path ran the same tile GEMMs between torch's
        elementwise ops, whose OpenMP threads took turns with the kernels' pool."""
        return I8_FUSE_ROWS if len(self.tiles) == len(self.types) else FUSE_ROWS

    def rows(self, i: int) -> int:
        return getattr(self, f"part{i}").shape[0]

    def pack_tiles(self) -> None:
        """int8 activations: each block-format part's codes repacked into 16-row tiles
        (`bs_ggml_a8_pack`), once; the file's bytes of that part are then dropped (the
        tiles hold the same codes). F32/F16/BF16 parts keep their rows."""
        if self.tiles or getattr(self, "_c_parts", None) is not None:
            return
        lib, ffi = c.get().lib, c.ffi()
        for i, (kind, data) in enumerate(self.parts()):
            group, bits = ffi.new("long *"), ffi.new("long *")
            args = (TYPES[kind], c.ptr(data, "void *"), data.shape[0], self.in_features)
            size = lib.bs_ggml_a8_pack(*args, ffi.NULL, ffi.NULL, group, bits)
            if size < 0:
                continue
            tiles = torch.empty(size, dtype=torch.uint8)
            sz = torch.empty(-(-data.shape[0] // 16) * (self.in_features // group[0]) * 32)
            lib.bs_ggml_a8_pack(*args, c.ptr(tiles, "uint8_t *"), c.ptr(sz), group, bits)
            self.register_buffer(f"tiles{i}", tiles, persistent=False)  # (counted as weights)
            self.register_buffer(f"sz{i}", sz, persistent=False)
            self.tiles[i] = (tiles, sz, group[0], bits[0])
            self.register_buffer(f"part{i}", data.new_empty(data.shape[0], 0), persistent=False)

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [out, in], as llama.cpp dequantizes it (the C dequantizer, or
        gguf-py's without the kernels)."""
        out = []
        for i, (kind, data) in enumerate(self.parts()):
            if i not in self.tiles:
                out.append(dequantize(kind, data, self.in_features))
                continue
            tiles, sz, group, bits = self.tiles[i]
            w = torch.empty(data.shape[0], self.in_features)
            c.get().lib.bs_ggml_a8_dequantize(
                c.ptr(tiles, "uint8_t *"),
                c.ptr(sz),
                data.shape[0],
                self.in_features,
                group,
                bits,
                c.ptr(w),
            )
            out.append(w)
        return torch.cat(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.c_weight is not None and rows.dtype is torch.float32 and not rows.requires_grad:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            y = self._kernels.gemv(self.c_weight, rows)
        else:  # no kernels: dequantized once, then fp32 matmuls
            if self.fallback_weight is None:
                self.fallback_weight = self.dequantize().to(x.device)
            y = F.linear(rows.float(), self.fallback_weight, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def dequantize(kind: str, data: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [rows, k] of raw rows of `kind` (C, or gguf-py's `quants.dequantize`)."""
    kernels = c.get()
    rows = data.shape[0]
    if kernels is not None and data.is_cpu:
        out = torch.empty(rows, k, dtype=torch.float32)
        data = data.contiguous()
        kernels.lib.bs_ggml_dequantize(TYPES[kind], c.ptr(data, "void *"), rows, k, c.ptr(out))
        return out
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    array = gguf_dequantize(data.cpu().numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(rows, k)
