"""Paged attention on CPU: write new K/V into the block pool, attend per sequence.

Layout: each layer's pool is head-major,
`[num_kv_heads, num_blocks, block_size, head_dim]`, so gathering a sequence's blocks
along dim 1 leaves every head's keys contiguous, which is what SDPA wants. Gathers go
into preallocated buffers (a fresh allocation page-faults and costs up to 10x).

Every row of a step goes to one batched call per layer (`DecodeBatch`), decodes and
prompt rows alike: the row at position p attends keys 0 .. p of its sequence through
the block tables (its own chunk's K/V are written first), so there is no per-sequence
Python, and windows and soft-capping are the call's too. The call is the C kernel
`paged_decode` on the CPU (reads in place; with the C layer around it, a 16 x 100-token
prefill of a 58M Llama went from 0.57 to 0.47 s; `python -m bench.llm_throughput
--attention` compares the decode case with the loop below), the Triton kernel on cuda
when it is there, else `torch_paged_decode`: the same contract in torch ops whose number
does not depend on the batch (gather every row's padded blocks at once, masked SDPA
over [rows, max context], in chunks of rows that bound the gathered bytes).

The per-sequence path below is kept for flash-attn (cuda, fp16/bf16, when it imports)
and for callers that hand one sequence (`quantize/scoring.py`); three cases per
sequence, chosen so SDPA keeps its fast paths:
- a fresh prefill (nothing cached before this chunk): attend to the new K/V directly,
  `is_causal=True`, no gather;
- a decode (one query token): gather the context, fold the GQA group into the query
  length (`[kv_heads, group, D]`), no mask;
- a later prefill chunk: gather the context, bottom-right causal mask.
The KV cache stays fp32 on CPU: bf16 SDPA there is 4-8x slower.

Sliding-window layers (`window`): a query at position q sees keys j with
q - window < j <= q (transformers' `sliding_window_overlay`); the gather starts at the
first block a query of the step can see, so blocks the block manager has freed below
every window (block_manager.py) are never read. Gemma 2's logit soft-capping
(`softcap`) cannot go through SDPA: those layers take `eager_attention`, which is
transformers' eager arithmetic (scores, cap * tanh(scores / cap), mask, fp32 softmax).

On a GPU (`EngineConfig.device`) the C kernels are never used and the pool is in the
model's dtype. When `flash_attn` imports and that dtype is fp16/bf16, the runner takes
the per-sequence path: fresh prefills go to `flash_attn_varlen_func` and attention over
gathered context to `flash_attn_with_kvcache` (bottom-right causal, GQA native).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class SeqSlice:
    start: int  # first row of this sequence in the flattened batch
    end: int
    context_len: int  # tokens in the cache after this step (computed + new)
    block_table: torch.Tensor  # the blocks covering context_len, int64

    @property
    def num_new(self) -> int:
        return self.end - self.start

    @property
    def fresh(self) -> bool:
        return self.num_new == self.context_len


@dataclass
class DecodeBatch:
    """Every row of a step, for the batched attention (all int32): a row is one query
    that attends the first context_lens keys of its sequence's blocks, a decode's and a
    prompt's alike (a prompt row at position p: p + 1, its chunk's K/V written first)."""

    rows: torch.Tensor  # [B]: the row of each query in the flattened batch
    block_tables: torch.Tensor  # [B, max blocks], its sequence's, padded with 0
    context_lens: torch.Tensor  # [B]: keys it attends
    seq_lens: torch.Tensor  # [B]: its sequence's tokens in the cache after this step


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]: block_id * block_size + offset of each new token
    seqs: list[SeqSlice]  # the sequences attended one by one (not in `decode`)
    workspace: GatherWorkspace | None = None
    decode: DecodeBatch | None = None
    flash: FlashAttn | None = None  # set on cuda when flash-attn imports
    # [T]: each row's sequence's rope_prefix, what picks its RoPE rotation (llm/rope.py)
    rope_prefix: torch.Tensor | None = None
    paged: Callable | None = None  # the `decode` rows' attention (`paged_decode`'s contract)
    store: Callable | None = None  # writes the step's K/V (`write_kv`'s contract; None: it)


@dataclass(frozen=True)
class FlashAttn:
    varlen: Any  # flash_attn.flash_attn_varlen_func
    with_kvcache: Any  # flash_attn.flash_attn_with_kvcache


_flash: FlashAttn | bool | None = False  # False: not tried yet


def flash_attn() -> FlashAttn | None:
    """flash-attn's functions when the package imports (never required), else None.

    `BITSERVE_NO_FLASH_ATTN=1` turns it off."""
    global _flash
    if _flash is False:
        _flash = None
        if os.environ.get("BITSERVE_NO_FLASH_ATTN") != "1":
            try:
                from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
            except Exception:  # ImportError, or a build that does not load here
                pass
            else:
                _flash = FlashAttn(flash_attn_varlen_func, flash_attn_with_kvcache)
    return _flash


@dataclass
class GatherWorkspace:
    """Preallocated gather buffers, shared by all layers (they run one after another)."""

    keys: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    values: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def gather(self, pool: torch.Tensor, which: str, block_table: torch.Tensor) -> torch.Tensor:
        heads, _, block_size, dim = pool.shape
        need = heads * len(block_table) * block_size * dim
        buf = getattr(self, which)
        if buf.numel() < need or buf.dtype != pool.dtype or buf.device != pool.device:
            buf = torch.empty(max(need, 2 * buf.numel()), dtype=pool.dtype, device=pool.device)
            setattr(self, which, buf)
        out = buf[:need].view(heads, len(block_table), block_size, dim)
        torch.index_select(pool, 1, block_table, out=out)
        return out.view(heads, len(block_table) * block_size, dim)


def write_kv(cache: tuple[torch.Tensor, torch.Tensor], k, v, slot_mapping) -> None:
    """Scatter this step's K/V ([T, Hkv, D]) into their slots of the layer's pool."""
    k_pool, v_pool = cache
    heads, num_blocks, block_size, dim = k_pool.shape
    k_flat = k_pool.view(heads, num_blocks * block_size, dim)
    v_flat = v_pool.view(heads, num_blocks * block_size, dim)
    k_flat.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_pool.dtype))
    v_flat.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_pool.dtype))


def paged_attention(
    q, k, v, cache, meta: AttentionMetadata, scale: float, window=None, softcap=None, kernels=None
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D].
    `meta.decode`'s rows go to `meta.paged` (or the C kernels' `paged_decode`), the
    sequences in `meta.seqs` one by one."""
    (meta.store or write_kv)(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode is not None:
        d = meta.decode
        paged = meta.paged or kernels.paged_decode
        paged(
            q.contiguous(),
            out,
            d.rows,
            cache[0],
            cache[1],
            d.block_tables,
            d.context_lens,
            scale,
            window=window or 0,
            softcap=softcap or 0.0,
        )
    flash = meta.flash  # windowed and soft-capped layers never reach it
    for s in meta.seqs:
        qs = q[s.start : s.end]
        if window is not None or softcap is not None:
            out[s.start : s.end] = windowed_attention(
                qs, k, v, cache, meta, s, scale, window, softcap
            )
        elif s.fresh:
            prefill = prefill_attention if flash is None else flash_prefill
            out[s.start : s.end] = prefill(qs, k[s.start : s.end], v[s.start : s.end], scale, flash)
        else:
            keys = meta.workspace.gather(cache[0], "keys", s.block_table)[:, : s.context_len]
            values = meta.workspace.gather(cache[1], "values", s.block_table)[:, : s.context_len]
            if flash is not None:
                attend = flash_context
            else:
                attend = decode_attention if s.num_new == 1 else chunk_attention
            out[s.start : s.end] = attend(qs, keys, values, scale, flash)
    return out


def windowed_attention(q, k, v, cache, meta, s: SeqSlice, scale, window, softcap):
    """One sequence's rows with a sliding window and/or soft-capping: the keys from the
    first one any of its queries sees (new K/V directly for a fresh chunk), a mask."""
    n, context = s.num_new, s.context_len
    first = 0 if window is None else max(0, context - n - window + 1)
    if s.fresh and first == 0:
        keys, values = k[s.start : s.end].transpose(0, 1), v[s.start : s.end].transpose(0, 1)
    else:
        bs = cache[0].shape[2]
        table = s.block_table[first // bs :]
        skip = first - first // bs * bs
        keys = meta.workspace.gather(cache[0], "keys", table)[:, skip : context - first + skip]
        values = meta.workspace.gather(cache[1], "values", table)[:, skip : context - first + skip]
    q_pos = torch.arange(context - n, context, device=q.device)[:, None]
    k_pos = torch.arange(first, context, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if softcap is not None:
        return eager_attention(q, keys, values, scale, mask, softcap)
    return masked_attention(q, keys, values, scale, mask)


def eager_attention(q, keys, values, scale, mask, softcap) -> torch.Tensor:
    """transformers' eager attention with soft-capping: q [n, Hq, D] against keys and
    values [Hkv, S, D]; mask [n, S] bool (True: attend)."""
    group = q.shape[1] // keys.shape[0]
    keys = keys.to(q.dtype).repeat_interleave(group, dim=0)
    values = values.to(q.dtype).repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values).transpose(0, 1)


def flash_prefill(q, k, v, scale: float, flash: FlashAttn) -> torch.Tensor:
    """`prefill_attention` through flash-attn: one sequence as a varlen batch of one."""
    n = q.shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    return flash.varlen(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True)


def flash_context(q, keys, values, scale: float, flash: FlashAttn) -> torch.Tensor:
    """Decode or later chunk through flash-attn: q [n, Hq, D] against the gathered
    context [Hkv, L, D], viewed (no copy) as a one-sequence cache [1, L, Hkv, D];
    flash-attn's causal mask is bottom-right aligned, as `chunk_attention`'s."""
    k_cache = keys.transpose(0, 1).unsqueeze(0)
    v_cache = values.transpose(0, 1).unsqueeze(0)
    o = flash.with_kvcache(q.unsqueeze(0), k_cache, v_cache, softmax_scale=scale, causal=True)
    return o[0]


def prefill_attention(q, k, v, scale: float, flash=None) -> torch.Tensor:
    """A chunk with no cached context: plain causal attention on the new K/V."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    o = F.scaled_dot_product_attention(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        is_causal=q.shape[2] > 1,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o[0].transpose(0, 1)


def decode_attention(q, keys, values, scale: float, flash=None) -> torch.Tensor:
    """One query token against the context [Hkv, L, D]: the GQA group becomes the query
    length, so each KV head is read once and no mask is needed."""
    kv_heads = keys.shape[0]
    qg = q.view(kv_heads, -1, q.shape[-1]).unsqueeze(0).to(keys.dtype)
    o = F.scaled_dot_product_attention(qg, keys.unsqueeze(0), values.unsqueeze(0), scale=scale)
    return o.view(1, -1, q.shape[-1]).to(q.dtype)


def chunk_attention(q, keys, values, scale: float, flash=None) -> torch.Tensor:
    """A prefill chunk after cached tokens: query i sees context up to L - n + i."""
    n, context = q.shape[0], keys.shape[1]
    mask = torch.ones(n, context, dtype=torch.bool, device=q.device).tril(diagonal=context - n)
    return masked_attention(q, keys, values, scale, mask)


def masked_attention(q, keys, values, scale: float, mask) -> torch.Tensor:
    """q [n, Hq, D] against keys and values [Hkv, S, D] through SDPA; mask [n, S] bool
    (True: attend)."""
    qh = q.transpose(0, 1).unsqueeze(0).to(keys.dtype)
    o = F.scaled_dot_product_attention(
        qh,
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=qh.shape[1] != keys.shape[0],
    )
    return o[0].transpose(0, 1).to(q.dtype)


GATHER_BYTES = 64 << 20  # torch_paged_decode gathers at most this many K+V bytes at once


def torch_paged_decode(
    q, out, rows, k_pool, v_pool, tables, lens, scale: float, window=0, softcap=0.0
) -> None:
    """`paged_decode` in torch ops: out[rows[i]] = attention of q[rows[i]] over the first
    lens[i] keys of block table tables[i] (the last `window` of them when window > 0;
    Gemma 2's soft-capping when softcap > 0). q, out: [T, Hq, D]; k_pool, v_pool:
    [Hkv, num_blocks, block_size, D]; rows, lens: [B]; tables: [B, W] (int32).

    Every row's W blocks are gathered at once and the keys past its length masked, so
    the ops are the same for 1 row as for 256 (no host read, no per-row Python); rows
    are taken in chunks whose gathered K/V stay under GATHER_BYTES, a number that
    follows from the shapes only."""
    heads, _, block_size, dim = k_pool.shape
    num_rows, width = tables.shape
    per_row = 2 * heads * width * block_size * dim * k_pool.element_size()
    chunk = max(1, GATHER_BYTES // per_row)
    key_pos = torch.arange(width * block_size, device=q.device)
    for a in range(0, num_rows, chunk):
        b = min(a + chunk, num_rows)
        idx, table, n = rows[a:b].long(), tables[a:b].long(), lens[a:b].long()
        # [Hkv, r, W, bs, D] -> [r, Hkv, W * bs, D]
        keys = k_pool[:, table].flatten(2, 3).transpose(0, 1)
        values = v_pool[:, table].flatten(2, 3).transpose(0, 1)
        mask = key_pos[None, :] < n[:, None]  # [r, L]
        if window:
            mask &= key_pos[None, :] >= (n - window)[:, None]
        qs = q.index_select(0, idx).unsqueeze(2).to(keys.dtype)  # [r, Hq, 1, D]
        if softcap:
            o = softcap_attention(qs, keys, values, scale, mask[:, None, None, :], softcap)
        else:
            o = F.scaled_dot_product_attention(
                qs,
                keys,
                values,
                attn_mask=mask[:, None, None, :],
                scale=scale,
                enable_gqa=qs.shape[1] != heads,
            )
        out.index_copy_(0, idx, o.squeeze(2).to(out.dtype))


def softcap_attention(q, keys, values, scale, mask, softcap) -> torch.Tensor:
    """`eager_attention`'s arithmetic, batched: q [r, Hq, 1, D] against keys and values
    [r, Hkv, L, D]; mask [r, 1, 1, L] bool (True: attend)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)
