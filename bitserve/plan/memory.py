"""How much memory an LLM needs in bitserve's engine: weights, KV cache, activations.

The KV cache is what grows with traffic: every token of every running sequence keeps
2 x layers x kv_heads x head_dim values, allocated in blocks of `block_size` tokens, so
the pool for N sequences of L tokens is N x ceil(L / block_size) blocks. `measure`
builds the real engine at that size and counts the bytes of every tensor it holds, so
the estimate is checked against what is allocated, not against another formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bitserve.plan.shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# Quantized weights, bytes per weight with their scales. int8: one byte plus an fp32
# scale per output row (per embedding row); int4: half a byte plus a bf16 scale and zero
# per group of 32 inputs (4 bytes / 32 = 0.125).
QUANT_BYTES = {None: None, "int8": 1.0, "int4": 0.5 + 4 / 32}
HUGE_PAGE = 2 << 20  # the engine aligns each KV pool of >= 2 MiB to a huge page


@dataclass
class MemoryPlan:
    weights: int
    kv_cache: int
    kv_padding: int  # huge-page alignment of each pool
    tables: int  # rotary cos/sin tables
    activations: int  # peak of one forward pass: an estimate, not allocated up front
    num_blocks: int

    @property
    def static(self) -> int:
        """What the engine allocates when it starts (everything but activations)."""
        return self.weights + self.kv_cache + self.kv_padding + self.tables

    @property
    def total(self) -> int:
        return self.static + self.activations


def weight_bytes(shape: ModelShape, dtype: str, quant: str | None) -> int:
    """The weights as the engine holds them. Quantized as `bitserve quantize` writes them
    (bitserve/llm/quant): the decoder's linear layers at the quantized width, the embedding
    in int8 with an fp32 scale per row, the LM head int8 (shared with a tied embedding)
    or, for int4, its own int4 copy; MoE experts at the quantized width like any linear
    layer; norms and biases stay in the model dtype."""
    width = DTYPE_BYTES[dtype]
    table = shape.vocab * shape.hidden  # one embedding (or LM head) matrix
    if quant is None:
        from bitserve.llm.models.llama import TIED_HEAD_COPY

        weights = (shape.layer_matrix_params() + shape.other_params()) * width
        # a small fp32 tied head gets its own packed copy (llama.py: pack_tied_head)
        small = table * width <= TIED_HEAD_COPY and shape.vocab % 16 == 0
        copy = shape.family != "gpt2" and shape.tied_embeddings and dtype == "float32" and small
        return weights + (table * width if copy else 0)
    tables = table * (1 if shape.tied_embeddings else 2)
    rest = shape.other_params() - tables  # norms, biases, learned positions
    matrices = shape.layer_matrix_params()
    embedding = shape.vocab * (shape.hidden + 4)
    if quant == "int8":
        linear = matrices * (1 + 4 / shape.hidden)  # the scale of each output row
        head = 0 if shape.tied_embeddings else embedding
    else:
        linear, head = matrices * QUANT_BYTES["int4"], table * QUANT_BYTES["int4"]
    return int(linear + embedding + head + rest * width)


def kv_pool(shape: ModelShape, max_seqs: int, context: int, kv_dtype: str, block_size: int):
    """(blocks, bytes, padding) of a pool holding `max_seqs` sequences of `context` tokens."""
    blocks = max_seqs * -(-context // block_size)
    size = blocks * block_size * shape.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
    per_pool = size // (2 * shape.layers)
    padding = 2 * shape.layers * HUGE_PAGE if per_pool >= HUGE_PAGE else 0
    return blocks, size, padding


def activation_bytes(shape: ModelShape, max_seqs: int, context: int, batched_tokens: int) -> int:
    """Peak live tensors of one step: a prefill chunk's hidden, qkv and MLP tensors (in
    fp32 on CPU), the fp32 logits of every sampled row, and the per-layer gather buffers
    that hold one sequence's K and V while attention runs (sized with room to grow 2x)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = 3 * shape.hidden + q + 2 * kv + 3 * shape.intermediate * shape.experts_per_token
    step = batched_tokens * per_token * 4
    logits = max_seqs * shape.vocab * 4
    gather = 2 * 2 * kv * context * 4
    return step + logits + gather


def estimate(
    shape: ModelShape,
    max_seqs: int,
    context: int,
    dtype: str = "float32",
    kv_dtype: str = "float32",
    quant: str | None = None,
    block_size: int = 16,
    batched_tokens: int = 2048,
) -> MemoryPlan:
    blocks, kv, padding = kv_pool(shape, max_seqs, context, kv_dtype, block_size)
    tables = 0 if shape.family == "gpt2" else 2 * context * shape.head_dim * 4
    return MemoryPlan(
        weights=weight_bytes(shape, dtype, quant),
        kv_cache=kv,
        kv_padding=padding,
        tables=tables,
        activations=activation_bytes(shape, max_seqs, context, min(batched_tokens, context)),
        num_blocks=blocks,
    )


def measure(model: Path, max_seqs: int, context: int, dtype: str = "float32") -> dict[str, int]:
    """Build the real engine sized for the plan and count its tensors' storage bytes
    (each storage once: tied weights and views share one)."""
    import torch

    from bitserve.llm.engine import LLMEngine

    probe = estimate(_shape(model), max_seqs, context, dtype)
    engine = LLMEngine(
        model, dtype=dtype, max_num_seqs=max_seqs, max_model_len=context,
        num_kv_blocks=probe.num_blocks,
    )  # fmt: skip
    seen: dict[int, int] = {}
    kv = 0
    for attn in engine.runner.attentions:
        for pool in attn.kv_cache:
            kv += _remember(seen, pool)
    tensors = [*engine.runner.model.parameters(), *engine.runner.model.buffers()]
    tensors += [v for m in engine.runner.model.modules() for v in vars(m).values()]
    other = sum(_remember(seen, t) for t in tensors if isinstance(t, torch.Tensor))
    return {
        "kv_cache": kv,
        "other": other,
        "total": kv + other,
        "num_blocks": engine.runner.num_blocks,
    }


def _remember(seen: dict[int, int], tensor) -> int:
    storage = tensor.untyped_storage()
    if storage.data_ptr() in seen or tensor.device.type == "meta":
        return 0
    seen[storage.data_ptr()] = storage.nbytes()
    return storage.nbytes()


def _shape(model: Path) -> ModelShape:
    from bitserve.plan.shape import from_config, read_config

    return from_config(read_config(model))
