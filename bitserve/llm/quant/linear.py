"""Quantized layers: int8, int8 with outlier channels, int4, and an int8 embedding.

Each layer keeps its quantized tensors as buffers (what is saved to safetensors) and
picks its kernels in `prepare()`, once its buffers sit on their device. On this CPU
(`python -m bench.quant` on the 58M bench model's shapes):

- int8, int8-outlier: with the C kernels, every row count through csrc/qgemm.c: up to
  SMALL_M rows its GEMV on fp32 x, above its int8 GEMM (x rounded per row, as below, and
  met by qweight itself in AVX512-VNNI dot products: exact int32 sums, so the same bits
  as the torch path; `python -m bench.gguf --kernels` times it against `torch._int_mm`).
  Without them: up to SMALL_M rows (decode) `_weight_int8pack_mm` (bf16 activations);
  above, `torch._int_mm` with int8 activations, vector-wise (per row) scales. Weight-only
  int8
  (`int8_activations=False`) uses int8pack up to PACK_MAX_M rows and a bf16
  dequantize + matmul above (measured faster there than int8pack) instead of _int_mm.
- int4: the C kernel at every row count (int8 activations in blocks of 32, as llama.cpp's
  q4_0 x q8_0; 3-4x the bf16 kernel at 1 row, ahead of bf16 matmul up to 256 rows);
  without the C kernels (or on a GPU), `_weight_int4pack_mm_for_cpu` /
  `_weight_int4pack_mm` (bf16 activations).

Small all-decode batches of plain int8 or int4 layers go one C call per decoder layer,
as fp32 decode does: `c_view()` is what that layer reads, `fuse_rows` up to how many rows.
With fp32 activations `_weight_int8pack_mm` is 4-30x slower than fp32, so activations go
to bf16 for the packed kernels and come back in their own dtype. A kernel that does not
exist on the device (or gives a wrong answer on a probe) is replaced by dequantize-and-
matmul, and the log says so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from bitserve import kernels as c

log = logging.getLogger("bitserve.quant")
aten = torch.ops.aten

SMALL_M = 4  # up to here the packed weight-only kernels win; above, _int_mm (W8A8) wins
PACK_MAX_M = 32  # weight-only int8: above, bf16 dequantize + matmul beats int8pack
# int8 activations: the C decode layer takes any number of rows (a prompt's in chunks of
# FUSED_CHUNK): above 256 rows the torch path ran the same GEMMs between torch's
# elementwise ops, whose OpenMP threads took turns with the kernels' pool at 2 threads
I8_FUSE_ROWS = 1 << 30
# int4 decode stays in C at any batch the scheduler makes: its int8-activation kernel
# beats bf16 matmul to 256 rows, and fused layers measured 1.06-1.15x unfused at 32-64
INT4_FUSE_ROWS = 256
_fallbacks_logged: set[str] = set()


def fallback(what: str, why: str) -> None:
    """Say once per kind of layer that it dequantizes instead of using a kernel."""
    if what not in _fallbacks_logged:
        _fallbacks_logged.add(what)
        log.warning("%s: no fast kernel (%s); dequantize-and-matmul instead", what, why)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~= q * scale[:, None], q in [-127, 127]."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vector-wise (per row) symmetric int8 activations, as LLM.int8() does."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127.0
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def flat(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class QuantLinear(nn.Module):
    """Common parts: sizes, optional fp32 bias, lazy kernel choice."""

    method = "none"
    fuse_rows = 0  # up to this many rows the C decode layer takes it (with a `c_view`)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)
        else:
            self.bias = None
        self.prepared_for: torch.device | None = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method}"

    def prepare(self) -> None:
        """Build the kernel-ready tensors on the buffers' device."""
        raise NotImplementedError

    def prepare_c(self) -> None:
        """The C GEMV view of this layer (a `Weight`, its bias left to torch), or None."""
        self.c_weight = None
        if self.device.type == "cpu" and (k := c.get()) is not None:
            self.c_weight = qweight(self, bias=False)
            self.c_kernels = k

    def c_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """Few fp32 rows through the C GEMV; None when it does not apply."""
        if self.c_weight is None or x.dtype is not torch.float32 or torch.is_grad_enabled():
            return None
        if x.stride(1) != 1:
            x = x.contiguous()
        return self.c_kernels.gemv(self.c_weight, x)

    def c_view(self, lora=None):
        """This layer as the C decode layer reads it (bias included), or None: plain int8
        and int4 with their C view built, not int8-outlier; `lora` as `c.fp32_weight`."""
        plain = type(self) in (Int8Linear, Int4Linear, Int4CheckpointLinear)
        built = plain and getattr(self, "c_weight", None) is not None
        return qweight(self, lora=lora) if built else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepared_for != self.device:
            self.prepare()
            self.prepared_for = self.device
        rows, lead = flat(x)
        y = self.matmul(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8 weights: W ~= qweight * scales[:, None].

    `int8_activations`: quantize the activations too (vector-wise, per row) and meet
    them in int8 above SMALL_M rows (W8A8: LLM.int8()'s baseline, bitsandbytes with
    threshold 0): the C int8 GEMM where the kernels are built, else `torch._int_mm` (the
    same sums and roundings, so the same bits); fewer rows keep x in fp32 (C) or bf16.
    That is 3-4x faster than weight-only at prefill sizes, and it is what activation
    outliers break. Off, the
    layer is weight-only (W8A16): the C GEMV (fp32 x) or int8pack up to SMALL_M rows,
    int8pack to PACK_MAX_M, then dequantize to bf16 and one bf16 matmul. Either way
    `qweight` [out, in] is the only copy of the weights every kernel reads.
    """

    method = "int8"
    a8_from = SMALL_M + 1  # with int8 activations: from how many rows x is rounded to int8

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, int8_activations=True
    ):
        super().__init__(in_features, out_features, bias)
        self.int8_activations = int8_activations
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))

    @classmethod
    def from_float(cls, linear: nn.Linear, int8_activations: bool = True) -> Int8Linear:
        out_f, in_f = linear.weight.shape
        layer = cls(in_f, out_f, linear.bias is not None, int8_activations)
        layer.qweight, layer.scales = quantize_rows_int8(linear.weight.detach())
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().float().clone()
        return layer

    @property
    def fuse_rows(self) -> int:
        return I8_FUSE_ROWS if self.int8_activations else SMALL_M

    def int8_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def dequantize(self) -> torch.Tensor:
        return self.int8_weight()

    def prepare(self) -> None:
        self.row_sums = None
        if self.int8_activations:  # the C int8 GEMM takes off x's + 128 with them
            self.row_sums = self.qweight.sum(dim=1, dtype=torch.int32)
            # up to SMALL_M rows x stays fp32 (the C GEMV; the torch path is weight-only
            # there too, int8pack): rounding those rows too moved the int8 arm's served
            # perplexity (bench.perplexity, 24.9426 -> 24.9470), for 1.3-3x at 1-4 rows
            self.a8_rows = self.a8_from
        self.prepare_c()
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        w = self.int8_weight()
        self.use_pack = probe(self, "int8pack", self.pack_matmul, w)
        self.use_int_mm = probe(self, "_int_mm", self.int_mm_matmul, w, rows=32)

    def pack_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales_bf16)

    def int_mm_matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_activations(x)
        return torch._int_mm(xq, self.qweight.t()) * xs * self.scales

    def dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.to(torch.bfloat16) * self.scales_bf16[:, None]
        return F.linear(x.to(torch.bfloat16), w)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if (self.int8_activations or m <= SMALL_M) and (y := self.c_matmul(x)) is not None:
            return y
        if m <= SMALL_M or (not self.int8_activations and m <= PACK_MAX_M):
            return self.pack_matmul(x) if self.use_pack else self.dequant_matmul(x)
        if self.int8_activations and self.use_int_mm and (x.is_cpu or m > 16):
            return self.int_mm_matmul(x)  # (CUDA's _int_mm wants M > 16)
        return self.dequant_matmul(x)


class Int8OutlierLinear(Int8Linear):
    """LLM.int8()'s mixed-precision decomposition with outlier columns fixed at calibration.

    Input channels whose calibrated absmax exceeded the threshold (`outlier_idx`) keep
    their weight columns in fp32 (`outlier_weight`, [out, n_outliers]); every other
    column is int8 per output row, and the int8 part sees the activations with the
    outlier channels zeroed, so their magnitude never sets the row's int8 scale.
    """

    method = "int8-outlier"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, n_out: int = 0):
        super().__init__(in_features, out_features, bias, int8_activations=True)
        self.register_buffer("outlier_idx", torch.zeros(n_out, dtype=torch.int64))
        self.register_buffer("outlier_weight", torch.zeros(out_features, n_out))

    @classmethod
    def from_float_with_outliers(
        cls, linear: nn.Linear, outliers: torch.Tensor
    ) -> Int8OutlierLinear:
        out_f, in_f = linear.weight.shape
        layer = cls(in_f, out_f, linear.bias is not None, len(outliers))
        w = linear.weight.detach().float()
        layer.outlier_idx = outliers.to(torch.int64).clone()
        layer.outlier_weight = w[:, outliers].contiguous()
        rest = w.index_fill(1, layer.outlier_idx, 0.0)
        layer.qweight, layer.scales = quantize_rows_int8(rest)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().float().clone()
        return layer

    def dequantize(self) -> torch.Tensor:
        w = super().dequantize()
        w[:, self.outlier_idx] = self.outlier_weight
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.outlier_idx.numel() == 0:
            return super().matmul(x)
        outliers = x[:, self.outlier_idx].float() @ self.outlier_weight.t()
        rest = x.index_fill(1, self.outlier_idx, 0.0)
        return super().matmul(rest) + outliers


class Int4Linear(QuantLinear):
    """Group-wise asymmetric 4-bit weights, in torch's int4pack convention.

    For each output row and each group of `group_size` input columns:
    W ~= (q - 8) * scale + zero, q in [0, 15]; `zero` is the value at the group's
    midpoint, so min and max of the group map to q = 0 and q = 15. Scales and zeros are
    bf16 [out, in / group_size], which is what the kernels take. `qweight` (what is
    saved) holds two q per byte, [out, padded in / 2]: in every 64 columns, column j sits
    in the low nibble of byte j and column 32 + j in its high nibble. The width is padded
    with zero columns to a multiple of 64 and of the group.

    Kernels: the C kernel at every row count (`tiled()` repacks the codes for it, and
    int8 activations meet them in VNNI dot products; csrc/qgemm.c); without
    it, torch's int4pack (bf16 activations). Either keeps its own copy of the codes and
    lets `qweight` go once the model is loaded (`free_unpacked`).
    """

    method = "int4"
    fuse_rows = INT4_FUSE_ROWS

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size=32):
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        unit = max(64, group_size)
        self.padded_in = -(-in_features // unit) * unit
        groups = self.padded_in // group_size
        self.register_buffer(
            "qweight", torch.zeros(out_features, self.padded_in // 2, dtype=torch.uint8)
        )
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.bfloat16))

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 32) -> Int4Linear:
        out_f, in_f = linear.weight.shape
        layer = cls(in_f, out_f, linear.bias is not None, group_size)
        w = F.pad(linear.weight.detach().float(), (0, layer.padded_in - in_f))
        w = w.view(out_f, -1, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
        zero = (lo + 8 * scale.float()).to(torch.bfloat16)
        q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]) + 8
        q = q.clamp(0, 15).to(torch.uint8).view(out_f, -1, 2, 32)
        layer.qweight = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out_f, -1)
        layer.scales, layer.zeros = scale, zero
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().float().clone()
        return layer

    def unpacked(self) -> torch.Tensor:
        """q as int32 [out, padded in], values 0..15."""
        b = self.qweight.view(self.out_features, -1, 1, 32)
        q = torch.cat([b & 15, b >> 4], dim=2)
        return q.view(self.out_features, self.padded_in).to(torch.int32)

    def tiled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The C kernel's layout (bitserve/kernels/csrc/qgemm.c, q4t), built once: codes
        [out / 16, padded in / 8, 16, 4] uint8 (a tile of 16 output rows; per 8 columns, 4
        bytes a row, column j low and j + 4 high) and bf16 [out / 16, groups, 2, 16] scales
        and zeros; `out` padded to a multiple of 16 with zero rows."""
        if getattr(self, "tiled_codes", None) is None:
            pad = -self.out_features % 16
            q = F.pad(self.unpacked(), (0, 0, 0, pad)).to(torch.uint8)
            q = q.view(-1, 16, self.padded_in // 8, 2, 4)  # tile, row, 8 columns, half, j
            codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
            sz = F.pad(torch.stack([self.scales, self.zeros], -1), (0, 0, 0, 0, 0, pad))
            sz = sz.to(self.scales.dtype).view(-1, 16, sz.shape[1], 2).permute(0, 2, 3, 1)
            self.tiled_codes, self.tiled_scales = codes, sz.contiguous()
        return self.tiled_codes, self.tiled_scales

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, padded in]: the padding columns multiply zeros."""
        q = self.unpacked().view(self.out_features, -1, self.group_size).to(dtype) - 8
        w = q * self.scales.to(dtype)[..., None] + self.zeros.to(dtype)[..., None]
        return w.view(self.out_features, self.padded_in)

    def prepare(self) -> None:
        # a model-wide .to(float32) (the hf backend does one) must not change the kernels'
        # bf16 scales and zeros
        self.scales, self.zeros = self.scales.to(torch.bfloat16), self.zeros.to(torch.bfloat16)
        if self.qweight.numel():  # not yet freed: (re)build the C layout from it
            self.tiled_codes = None
        self.prepare_c()
        self.packed, self.use_pack = None, False
        if self.c_weight is not None:
            return
        # [in / group, out, 2] bf16: what both int4pack kernels take
        pairs = torch.stack([self.scales, self.zeros], -1).to(torch.bfloat16)
        self.scales_and_zeros = pairs.transpose(0, 1).contiguous()
        try:
            q = self.unpacked()
            if self.device.type == "cpu":
                self.packed = aten._convert_weight_to_int4pack_for_cpu(q, 1)
            else:  # torch's CUDA packing wants two q a byte, even column high
                pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                self.packed = aten._convert_weight_to_int4pack(pairs, 8)
        except (RuntimeError, NotImplementedError) as e:
            fallback("int4 linear", f"int4pack conversion: {e}".splitlines()[0])
        w = self.dequantize()
        self.use_pack = self.packed is not None and probe(self, "int4pack", self.pack_matmul, w)
        if not self.use_pack:
            self.packed = None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.pad(x, (0, self.padded_in - self.in_features)) if self.padded_in > x.shape[1] else x
        )

    def pack_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pad(x.to(torch.bfloat16))
        if self.device.type == "cpu":
            return aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scales_and_zeros
            )
        return aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)

    def dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.pad(x.to(torch.bfloat16)), self.dequantize(torch.bfloat16))

    def free_unpacked(self) -> None:
        """Drop `qweight` once the C kernel or int4pack holds its own copy of the codes
        (and the scales and zeros too once the C kernel's tiles hold them)."""
        if self.use_pack or self.c_weight is not None:
            self.qweight = torch.empty(0, dtype=torch.uint8, device=self.device)
        if self.c_weight is not None:
            self.scales = self.zeros = torch.empty(0, dtype=self.scales.dtype, device=self.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_weight is not None:  # any row count: it beats bf16 matmul at 1-256 rows
            x = x.float() if x.stride(1) == 1 else x.float().contiguous()
            return self.c_kernels.gemv(self.c_weight, x)
        return self.pack_matmul(x) if self.use_pack else self.dequant_matmul(x)


class Int4CheckpointLinear(Int4Linear):
    """An AWQ or GPTQ layer (llm/quant/checkpoints.py) on the int4 kernel, its scales and
    zeros fp32 so the checkpoint's fp16 ones are carried exactly.

    A checkpoint's W = (q - zero) * s (zero an integer, s fp16) is held as Int4Linear's
    (q - 8) * s + z with z = (8 - zero) * s: a 4-bit integer times an fp16 is exact in
    fp32, and so is the kernel's z - 8 s = -zero * s. `perm` (GPTQ act-order), or None:
    stored column k is input column perm[k], so that each group's columns are contiguous;
    the C kernel gathers x by it as it quantizes x (no extra pass), and `dequantize`
    returns the columns in the input's order. Without the C kernels: the dequantized fp32
    weight, kept (int4pack's bf16 scales would round the checkpoint's).
    """

    method = "int4-checkpoint"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size=128):
        super().__init__(in_features, out_features, bias, group_size)
        self.scales, self.zeros = self.scales.float(), self.zeros.float()
        self.register_buffer("perm", None)

    def fill(self, q, zero, scale, perm=None) -> None:
        """q [out, in] (0..15, perm's column order), zero and scale [out, groups]."""
        pad = self.padded_in - self.in_features
        q = F.pad(q.to(torch.uint8), (0, pad)).view(self.out_features, -1, 2, 32)
        self.qweight = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(self.out_features, -1)
        groups = self.padded_in // self.group_size - scale.shape[1]  # padding: W = 0
        self.scales = F.pad(scale.float(), (0, groups))
        self.zeros = F.pad((8 - zero.float()) * scale.float(), (0, groups))
        self.perm = None if perm is None else perm.to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = super().dequantize(torch.float32)
        if self.perm is not None:
            w[:, self.perm.long()] = w[:, : self.in_features].clone()
        return w.to(dtype)

    def prepare(self) -> None:
        if self.qweight.numel():
            self.tiled_codes = None
        self.prepare_c()
        self.packed, self.use_pack, self.dense = None, False, None
        if self.c_weight is None:
            self.dense = self.dequantize()

    def free_unpacked(self) -> None:
        if self.c_weight is not None:
            super().free_unpacked()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_weight is not None:
            return super().matmul(x)
        return F.linear(self.pad(x.float()), self.dense)


def probe(layer: QuantLinear, name: str, kernel, weight: torch.Tensor, rows: int = 1) -> bool:
    """Does `kernel` run here and agree with `weight`, dequantized? (once per layer)"""
    x = torch.randn(rows, layer.in_features, device=layer.device)
    try:
        got = kernel(x).float()
        weight = weight[:, : layer.in_features]
    except (RuntimeError, NotImplementedError) as e:
        fallback(f"{layer.method} linear ({name})", str(e).splitlines()[0])
        return False
    want = x @ weight.t()
    err = (got - want).norm() / want.norm().clamp(min=1e-12)
    if not err < 0.05:
        fallback(f"{layer.method} linear ({name})", f"probe error {float(err):.3g}")
        return False
    return True


class Int8Embedding(nn.Module):
    """Token embeddings as per-row int8: a lookup reads and dequantizes only its rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer(
            "qweight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8)
        )
        self.register_buffer("scales", torch.ones(num_embeddings, dtype=torch.float32))

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> Int8Embedding:
        layer = cls(*embedding.weight.shape, dtype=embedding.weight.dtype)
        layer.qweight, layer.scales = quantize_rows_int8(embedding.weight.detach())
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].to(self.dtype)
        return rows * self.scales[ids].to(self.dtype).unsqueeze(-1)


def tied_head(embedding: Int8Embedding, int8_activations: bool = True) -> Int8Linear:
    """An lm_head that shares the int8 embedding's tensors (tied word embeddings)."""
    head = Int8Linear(embedding.embedding_dim, embedding.num_embeddings, False, int8_activations)
    head.qweight, head.scales = embedding.qweight, embedding.scales
    return head


QUANT_MODULES = (QuantLinear, Int8Embedding)


def qweight(layer, bias: bool = True, lora=None):
    """The C view (`Weight`) of an Int8Linear or Int4Linear: pointers into its buffers,
    which must stay alive as long as the view; `lora`: its LoRA slots (c.fp32_weight)."""
    fields = {"N": layer.out_features, "K": layer.in_features, "bias": c.ptr(None)}
    if lora is not None:
        a, bt, slots = lora
        fields |= {"lora_a": c.ptr(a), "lora_bt": c.ptr(bt), "lora_slots": c.ptr(slots, "int *")}
        fields |= {"lora_S": a.shape[0], "lora_W": a.shape[1]}
    if bias:
        fields["bias"] = c.ptr(layer.bias)
    if isinstance(layer, Int4Linear):
        codes, scales_zeros = layer.tiled()
        fields |= {"kind": 2, "data": c.ptr(codes, "void *")}
        if scales_zeros.dtype is torch.float32:  # a checkpoint's (Int4CheckpointLinear)
            fields["scale"] = c.ptr(scales_zeros)
        else:
            fields["s4"] = c.ptr(scales_zeros, "uint16_t *")
        fields |= {"Kp": layer.padded_in, "group": layer.group_size}
        fields["perm"] = c.ptr(getattr(layer, "perm", None), "int32_t *")  # GPTQ act-order
    else:
        fields |= {"kind": 1, "data": c.ptr(layer.qweight, "void *"), "scale": c.ptr(layer.scales)}
        if getattr(layer, "row_sums", None) is not None:  # int8 activations above a8_rows
            fields |= {"wsum": c.ptr(layer.row_sums, "int32_t *"), "a8_rows": layer.a8_rows}
    return c.ffi().new("Weight *", fields)
