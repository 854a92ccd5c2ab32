"""Paged attention on a GPU as Triton kernels: every row of a step in one launch.

The contract is the C kernel's (`kernels.paged_decode`, see attention.py): a row is one
query at position p that attends keys 0 .. p of its sequence (context_lens = p + 1),
read in place through its sequence's block table, after the step's own K/V were written
into the pool. Decodes, fresh prefill chunks, chunks after a cached prefix are all the
same kind of row, so a mixed step is one launch, with no gather and no mask tensor.

Layout (per layer): pools `[num_kv_heads, num_blocks, block_size, head_dim]`, last dim
contiguous; key j of row b lives at block `block_tables[b, j // block_size]`, slot
`j % block_size`. q and out are `[T, Hq, D]` (any row/head stride); q head
`h * group + g` uses KV head h (transformers' repeat_interleave order).

What a program does (`_attention_kernel`, grid `(rows, kv heads, splits)`): it loads the
whole query group of its KV head as a `[GROUP_P, D_P]` tile (padded to 16 rows so both
products run on the tensor cores; padded rows are zeros and never stored), then walks
its keys in tiles of TILE: per key the block id from the table, one K tile and one V tile
read from the pool in place, scores = q K^T * scale (soft-capped: cap * tanh(s / cap)),
keys outside `[lo, hi)` at -inf, and the online softmax in fp32 (running max m, sum l,
accumulator acc). Each KV head is read once for its whole group. A sliding window
(`window` > 0) starts the walk at key p - window + 1 (q - window < j <= q), so blocks the
block manager freed below the window are never touched.

Split-K (flash decoding): with few rows, (rows x kv heads) programs leave most of the GPU
idle, so the keys are cut into `splits` equal ranges of `split_len`; each program writes
its (m, l, acc) to a scratch buffer and `_combine_kernel` merges them. The split count
depends only on the shapes (rows, table width), never on the lengths, so a step with the
same shapes always launches the same grid (CUDA graphs replay it).

A prefill chunk of n rows through the row kernel reads its context n times.
`_prefill_kernel` (`paged_prefill_triton`, grid `(sequences, query blocks, kv heads)`)
takes the same step per sequence instead (query_start, seq_lens, one table row each):
a program holds BLOCK_Q consecutive rows x the query group (M = BLOCK_Q * group query
vectors, each masking its own keys: j <= p, j > p - window), so each K/V tile is read
once per BLOCK_Q rows. The runner can send decode rows to the row kernel (split-K, CUDA
graphs) and chunks here, or everything to the row kernel: the results are the same.

`_store_kv_kernel` writes the step's K and V into their slots in one launch (slot < 0:
a padding row, skipped).

`paged_attention_reference` is the same arithmetic in torch with the same block-table
indexing, the kernel's reference on a device; the tests run the kernels in Triton's
interpreter (tests/conftest.py sets `TRITON_INTERPRET=1` before triton is imported)
against it and against SDPA on the dense contexts, and compile them for sm_90 with
Triton's own compiler (tests/llm/triton_compile_check.py), which needs no GPU. The
interpreter stores bf16 as uint16 and cannot multiply it, so there (only) bf16 tiles
are upcast to fp32 before the products (`UPCAST`); on a GPU fp16/bf16 tiles go to the
tensor cores as they are, fp32 ones with IEEE precision (no TF32), so fp32 results
match the CPU path's.
"""

import os
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU images: the C kernels are the attention path there
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # the kernels below are defined, never run

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by @triton.jit below


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def available() -> bool:
    """Whether the GPU path can run: triton imports, torch is a CUDA build and sees a
    device. The interpreter (tests) does not count, so an engine on the CPU never picks
    it, nor one on the tests' pretend device (a CPU-only torch)."""
    return triton is not None and torch.version.cuda is not None and torch.cuda.is_available()


@_jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # inf-safe at both ends


@_jit
def _kv_tile(
    table,
    k_head,
    v_head,
    j,
    j_ok,
    d,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """The K and V tiles of keys j (j_ok: those in range), read in place through the
    sequence's block table."""
    block = tl.load(table + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
    slot = j % BLOCK_SIZE
    kv_mask = j_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(
        k_head + (block * stride_kb + slot * stride_ks)[:, None] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_head + (block * stride_vb + slot * stride_vs)[:, None] + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    return k, v


@_jit
def _scores(
    q, k, scale, softcap, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr
):
    """q K^T * scale, soft-capped (cap * tanh(s / cap)) when the model asks."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
    s = s * scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@_jit
def _pv(p, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        return tl.dot(p, v.to(tl.float32))
    return tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@_jit
def _attention_kernel(
    q_ptr,
    out_ptr,
    rows_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    acc_ptr,  # split partials [rows, kv heads, splits, GROUP_P, D_P], fp32
    m_ptr,  # [rows, kv heads, splits, GROUP_P], fp32
    l_ptr,
    scale,
    softcap,
    window,
    split_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_tb,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    ctx = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    lo = tl.maximum(start, split * split_len)
    hi = tl.minimum(ctx, split * split_len + split_len)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = (h * GROUP + g).to(tl.int64)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0
    )

    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    table = tables_ptr + b.to(tl.int64) * stride_tb
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh
    # Every tile of this walk holds at least one key of [lo, hi): m is finite after it.
    for t0 in range(lo // TILE * TILE, hi, TILE):
        j = t0 + tl.arange(0, TILE)
        j_ok = (j >= lo) & (j < hi)
        k, v = _kv_tile(
            table,
            k_head,
            v_head,
            j,
            j_ok,
            d,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        s = _scores(q, k, scale, softcap, SOFTCAP, UPCAST, PRECISION)
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _pv(p, v, UPCAST, PRECISION)
        m = m_new

    if SPLITS == 1:
        o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # no keys (a padding row): 0
        o_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        part = (b.to(tl.int64) * tl.num_programs(1) + h) * SPLITS + split
        tl.store(m_ptr + part * GROUP_P + g, m)
        tl.store(l_ptr + part * GROUP_P + g, l_sum)
        tl.store(acc_ptr + (part * GROUP_P + g)[:, None] * D_P + d[None, :], acc)


@_jit
def _combine_kernel(
    out_ptr,
    rows_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Merge the splits' (m, l, acc) of one (row, kv head); empty splits have m = -inf."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    first = (b.to(tl.int64) * tl.num_programs(1) + h) * SPLITS
    for split in range(SPLITS):
        part = first + split
        m_s = tl.load(m_ptr + part * GROUP_P + g)
        l_s = tl.load(l_ptr + part * GROUP_P + g)
        acc_s = tl.load(acc_ptr + (part * GROUP_P + g)[:, None] * D_P + d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both empty so far
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
    heads = (h * GROUP + g).to(tl.int64)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    o_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :]
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=gd_mask)


@_jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    q_start_ptr,
    seq_lens_ptr,
    tables_ptr,
    k_ptr,
    v_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_tb,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    M_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """BLOCK_Q consecutive query rows of one sequence x the query group of one KV head
    (M = BLOCK_Q * GROUP query vectors), so each K/V tile is read once for all of them;
    query m is row m // GROUP, head h * GROUP + m % GROUP, and masks its own keys."""
    seq = tl.program_id(0)
    h = tl.program_id(2)
    q_lo = tl.load(q_start_ptr + seq)
    q_hi = tl.load(q_start_ptr + seq + 1)
    ctx = tl.load(seq_lens_ptr + seq)
    first = q_lo + tl.program_id(1) * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, q_hi) - 1  # < first: no rows for this program

    mi = tl.arange(0, M_P)
    row = first + mi // GROUP
    row_ok = (mi < BLOCK_Q * GROUP) & (row <= last)
    pos = ctx - q_hi + row  # the new tokens are the last of the context
    d = tl.arange(0, D_P)
    md_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    heads = (h * GROUP + mi % GROUP).to(tl.int64)
    q_off = row.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=md_mask, other=0.0)
    win = tl.where(window > 0, window, ctx + 1)  # no window: every key passes j > pos - win

    m = tl.full([M_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([M_P], tl.float32)
    acc = tl.zeros([M_P, D_P], tl.float32)
    lo = tl.maximum(ctx - q_hi + first - win + 1, 0)
    hi = tl.where(last >= first, ctx - q_hi + last + 1, 0)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    k_head = k_ptr + h.to(tl.int64) * stride_kh
    v_head = v_ptr + h.to(tl.int64) * stride_vh
    for t0 in range(lo // TILE * TILE, hi, TILE):
        j = t0 + tl.arange(0, TILE)
        j_ok = (j >= lo) & (j < hi)
        k, v = _kv_tile(
            table,
            k_head,
            v_head,
            j,
            j_ok,
            d,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        s = _scores(q, k, scale, softcap, SOFTCAP, UPCAST, PRECISION)
        seen = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - win)
        s = tl.where(j_ok[None, :] & seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _pv(p, v, UPCAST, PRECISION)
        m = m_new

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_off = row.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=md_mask)


@_jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_pool,
    v_pool,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ph,
    stride_pb,
    stride_ps,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Token t's K and V of KV head h into their slot of the pools (same strides)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, D_P)
    mask = (d < HEAD_DIM) & (slot >= 0)
    dst = h * stride_ph + (slot // BLOCK_SIZE) * stride_pb + (slot % BLOCK_SIZE) * stride_ps + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_pool + dst, k.to(k_pool.dtype.element_ty), mask=mask)
    tl.store(v_pool + dst, v.to(v_pool.dtype.element_ty), mask=mask)


def _launch(kernel, grid, *args, **constexprs) -> None:
    """Every launch goes through here (tests/llm/triton_compile_check.py swaps it for a
    compile for an sm_90 target, which needs no GPU)."""
    kernel[grid](*args, **constexprs)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


_sm_counts: dict[int, int] = {}


def default_splits(num_rows: int, kv_heads: int, max_context: int, device) -> int:
    """Splits so (rows x kv heads x splits) programs fill about two waves of the GPU's
    SMs, each split at least 256 keys; a function of shapes only (graph-safe)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = -(-2 * _sm_counts[index] // max(1, num_rows * kv_heads))
    return max(1, min(want, -(-max_context // 256), 32))


def _check(q, out, k_pool, v_pool, block_tables, **int32s) -> None:
    hkv, _, bs, d = k_pool.shape
    if q.dim() != 3 or out.shape != q.shape or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q/out {tuple(q.shape)} do not fit the pool {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError("k_pool and v_pool differ in shape or dtype")
    if bs & (bs - 1) or d > 256:
        raise ValueError(f"block_size must be a power of two and head_dim <= 256 ({bs}, {d})")
    for name, t in (("q", q), ("out", out), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    for name, t in {**int32s, "block_tables": block_tables}.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [rows, max blocks], contiguous rows")


def paged_attention_triton(
    q,
    out,
    rows,
    k_pool,
    v_pool,
    block_tables,
    context_lens,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    splits: int | None = None,
    tile: int | None = None,
) -> None:
    """`kernels.paged_decode` on a GPU: out[rows[b]] = attention of q[rows[b]] over the
    first context_lens[b] keys of block_tables[b] (window > 0: the last `window` only;
    softcap > 0: Gemma 2's). q, out: [T, Hq, D], same device as the pools, fp32/bf16/fp16;
    rows, context_lens: int32 [B]; block_tables: int32 [B, W] (W * block_size >= every
    context; padding entries are never read). Rows not in `rows` are left alone; a row
    with context_lens 0 (padding, e.g. of a CUDA graph's batch) gets zeros.
    `splits`: key ranges per row (None: `default_splits`); `tile`: keys per step (>= 16)."""
    _check(q, out, k_pool, v_pool, block_tables, rows=rows, context_lens=context_lens)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return
    hkv, _, bs, d = k_pool.shape
    group = q.shape[1] // hkv
    group_p, d_p = _pow2(group), _pow2(d)
    tile = tile or (32 if d > 128 else 64)
    max_context = block_tables.shape[1] * bs
    if splits is None:
        splits = default_splits(num_rows, hkv, max_context, q.device)
    split_len = -(-max(1, -(-max_context // splits)) // tile) * tile
    if splits > 1:
        acc = torch.empty(num_rows, hkv, splits, group_p, d_p, device=q.device)
        m = torch.empty(num_rows, hkv, splits, group_p, device=q.device)
        l_sum = torch.empty_like(m)
    else:
        acc = m = l_sum = out  # not touched
    upcast = _INTERPRET and k_pool.dtype == torch.bfloat16
    _launch(
        _attention_kernel,
        (num_rows, hkv, splits),
        *(q, out, rows, k_pool, v_pool, block_tables, context_lens, acc, m, l_sum),
        *(float(scale), float(softcap or 0.0), int(window or 0), split_len),
        *(q.stride(0), q.stride(1), out.stride(0), out.stride(1)),
        *(k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)),
        *(v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0)),
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=d,
        D_P=d_p,
        BLOCK_SIZE=bs,
        TILE=tile,
        SPLITS=splits,
        SOFTCAP=bool(softcap),
        UPCAST=upcast,
        PRECISION="ieee" if k_pool.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        _launch(
            _combine_kernel,
            (num_rows, hkv),
            *(out, rows, acc, m, l_sum, out.stride(0), out.stride(1)),
            GROUP=group,
            GROUP_P=group_p,
            HEAD_DIM=d,
            D_P=d_p,
            SPLITS=splits,
        )


def paged_prefill_triton(
    q,
    out,
    query_start,
    seq_lens,
    k_pool,
    v_pool,
    block_tables,
    scale: float,
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
    block_q: int | None = None,
    tile: int | None = None,
) -> None:
    """Prefill chunks per sequence, each K/V tile read once for BLOCK_Q query rows (the
    row kernel reads a sequence's context once per row). Sequence s's query rows are
    q[query_start[s] : query_start[s + 1]], the last tokens of its seq_lens[s] (their K/V
    already in the pool); a query at position p sees keys 0 .. p (window > 0: the last
    `window`), as in `paged_attention_triton`. query_start: int32 [S + 1]; seq_lens:
    int32 [S]; block_tables: int32 [S, W], one row per sequence; max_query_len: the
    longest chunk, a host int (it sizes the grid). Rows of no sequence are left alone."""
    _check(q, out, k_pool, v_pool, block_tables, query_start=query_start, seq_lens=seq_lens)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return
    hkv, _, bs, d = k_pool.shape
    group = q.shape[1] // hkv
    block_q = block_q or max(1, 64 // triton.next_power_of_2(group))
    tile = tile or (32 if d > 128 else 64)
    _launch(
        _prefill_kernel,
        (num_seqs, -(-max_query_len // block_q), hkv),
        *(q, out, query_start, seq_lens, block_tables, k_pool, v_pool),
        *(float(scale), float(softcap or 0.0), int(window or 0)),
        *(q.stride(0), q.stride(1), out.stride(0), out.stride(1)),
        *(k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)),
        *(v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0)),
        GROUP=group,
        BLOCK_Q=block_q,
        M_P=_pow2(block_q * group),
        HEAD_DIM=d,
        D_P=_pow2(d),
        BLOCK_SIZE=bs,
        TILE=tile,
        SOFTCAP=bool(softcap),
        UPCAST=_INTERPRET and k_pool.dtype == torch.bfloat16,
        PRECISION="ieee" if k_pool.dtype == torch.float32 else "tf32",
    )


def write_kv_triton(cache: tuple[torch.Tensor, torch.Tensor], k, v, slot_mapping) -> None:
    """attention.write_kv in one launch: k, v [T, Hkv, D] (last dim contiguous) into
    their slots (slot_mapping [T], int32/int64; a negative slot is skipped)."""
    k_pool, v_pool = cache
    hkv, _, bs, d = k_pool.shape
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1:
        raise ValueError("k_pool and v_pool must share strides, last dim contiguous")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in their last dim")
    if k.shape[0] == 0:
        return
    _launch(
        _store_kv_kernel,
        (k.shape[0], hkv),
        *(k, v, k_pool, v_pool, slot_mapping, k.stride(0), k.stride(1), v.stride(0)),
        *(v.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)),
        HEAD_DIM=d,
        D_P=_pow2(d, least=1),
        BLOCK_SIZE=bs,
    )


def paged_attention_reference(
    q, out, rows, k_pool, v_pool, block_tables, context_lens, scale, window=0, softcap=0.0
) -> None:
    """The kernel's arithmetic in torch, row by row, with the same indexing: key j of row
    b at block_tables[b, j // block_size], slot j % block_size, keys from
    max(0, context - window) (window > 0), fp32 scores and softmax."""
    hkv, _, bs, d = k_pool.shape
    group = q.shape[1] // hkv
    for b in range(rows.shape[0]):
        row, ctx = int(rows[b]), int(context_lens[b])
        j = torch.arange(max(0, ctx - window) if window else 0, ctx, device=k_pool.device)
        blocks = block_tables[b, j // bs].long()
        keys = k_pool[:, blocks, j % bs].float()  # [hkv, L, D]
        values = v_pool[:, blocks, j % bs].float()
        qg = q[row].to(k_pool.dtype).float().view(hkv, group, d)
        s = qg @ keys.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        o = torch.softmax(s, dim=-1) @ values
        out[row] = o.reshape(hkv * group, d).to(out.dtype)
