"""Quantized decode steps in one C call per layer, as the fp32 engine runs them.

The engine's fused fp32 decode (`LlamaForCausalLM.fused_decode`) reads fp32 weight
pointers, so a quantized model turns it off. Instead each Llama decoder layer whose
linear layers are all plain int8 or int4 (not int8-outlier) gets a subclass of
its own class whose `forward` sends a small all-decode batch to
`bs_q_llama_decode_layer` (bitserve/quant/kernels.py) and everything else (prefill,
mixed batches, more rows than `fuse_rows`, a GPU) to the layer's own forward. The module
tree and parameter names do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from bitserve.llm import kernels as llm_kernels
from bitserve.llm.attention import AttentionMetadata
from bitserve.quant import kernels as qkernels
from bitserve.quant.linear import SMALL_M, Int4Linear, Int8Linear, QuantLinear, qweight

# int4 decode stays in C at any batch the scheduler makes: its int8-activation kernel
# beats bf16 matmul to 256 rows, and fused layers measured 1.06-1.15x unfused at 32-64
INT4_FUSE_ROWS = 256

_classes: dict[type, type] = {}


def c_readable(layer: nn.Module) -> bool:
    """Plain int8 (not int8-outlier) or int4, with its C view built."""
    plain = type(layer) is Int8Linear or type(layer) is Int4Linear
    return plain and getattr(layer, "c_weight", None) is not None


def fusable(layer: nn.Module) -> bool:
    """A Llama decoder layer with plain SwiGLU MLP, no TP, all four linears C-readable,
    and Llama's norms (no qk-norm, sandwich or `1 + w` norms: Qwen3 and Gemma stay in torch)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = [
        getattr(attn, "qkv_proj", None),
        getattr(attn, "o_proj", None),
        getattr(mlp, "gate_up_proj", None),
        getattr(mlp, "down_proj", None),
    ]
    tp = getattr(mlp, "tp", None)
    return (
        all(lin is not None and c_readable(lin) for lin in linears)
        and hasattr(layer, "input_layernorm")
        and getattr(attn, "q_norm", None) is None
        and not getattr(layer, "sandwich", False)
        and not layer.input_layernorm.unit_offset
        and getattr(mlp, "activation", "silu") == "silu"
        and (tp is None or tp.size == 1)
    )


def fuse_decode_layers(model: nn.Module) -> int:
    """Swap the class of every fusable decoder layer; returns how many."""
    if qkernels.get() is None:
        return 0
    count = 0
    for layer in getattr(model, "layers", []):
        if fusable(layer):
            base = type(layer)
            if base not in _classes:
                _classes[base] = type(f"QuantFused{base.__name__}", (FusedDecode, base), {})
            layer.__class__ = _classes[base]
            layer.fuse_rows = fuse_rows(layer)
            count += 1
    return count


def fuse_rows(layer: nn.Module) -> int:
    """int4 layers fuse batched decode up to INT4_FUSE_ROWS rows; int8 ones up to SMALL_M
    (above, unfused _int_mm measured faster than the fused VNNI path at 16 rows)."""
    linears = [m for m in layer.modules() if isinstance(m, QuantLinear)]
    return INT4_FUSE_ROWS if all(type(m) is Int4Linear for m in linears) else SMALL_M


class FusedDecode:
    """Mixed into a decoder layer class: the C path for small all-decode batches."""

    def forward(self, x, positions, meta: AttentionMetadata, rotary):
        if self.can_fuse(x, meta, rotary):
            return self.fused(x, positions, meta, rotary)
        return super().forward(x, positions, meta, rotary)

    def can_fuse(self, x: torch.Tensor, meta: AttentionMetadata, rotary) -> bool:
        attn = self.self_attn
        return (
            meta.decode is not None
            and not meta.seqs
            and x.dim() == 2
            and x.shape[0] <= self.fuse_rows
            and x.dtype is torch.float32
            and x.is_cpu
            and not torch.is_grad_enabled()
            and rotary is not None
            and rotary.cos.shape[-1] == attn.head_dim
            and attn.kv_cache is not None
            and attn.kv_cache[0].dtype is torch.float32
        )

    def c_params(self, rotary) -> qkernels.QLayerParams:
        """The C view of this layer, rebuilt when its KV pool or RoPE tables change."""
        attn, mlp = self.self_attn, self.mlp
        key = (attn.kv_cache, rotary.cos, rotary.sin)
        cached = getattr(self, "_c_params", None)
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        k_pool, v_pool = attn.kv_cache
        params = qkernels.QLayerParams(
            ln1=self.input_layernorm.weight.data_ptr(),
            ln2=self.post_attention_layernorm.weight.data_ptr(),
            qkv=qweight(attn.qkv_proj),
            o=qweight(attn.o_proj),
            gu=qweight(mlp.gate_up_proj),
            down=qweight(mlp.down_proj),
            kpool=k_pool.data_ptr(),
            vpool=v_pool.data_ptr(),
            cos=rotary.cos.data_ptr(),
            sin=rotary.sin.data_ptr(),
            **llm_kernels.layer_shape(self),
        )
        self._c_params = (key, params)
        return params

    def fused(self, x, positions, meta: AttentionMetadata, rotary) -> torch.Tensor:
        attn = self.self_attn
        per_row = 2 * x.shape[1] + 2 * (attn.q_size + attn.kv_size) + 3 * self.mlp.intermediate
        scratch = getattr(self, "_scratch", None)
        if scratch is None or scratch.numel() < per_row * x.shape[0]:  # grown as batches grow
            rows = min(self.fuse_rows, 1 << (x.shape[0] - 1).bit_length())
            scratch = self._scratch = torch.empty(per_row * rows)
        x = x.contiguous().clone()  # updated in place by the kernel
        qkernels.get().decode_layer(
            self.c_params(rotary), x, positions, meta.slot_mapping, meta.decode, scratch
        )
        return x
