"""The Triton paged-attention kernels, run in Triton's interpreter on the CPU.

Each case builds sequences' K/V as dense tensors, scatters them into a pool at random
blocks (the free blocks hold NaN, so a stray read shows), and holds the kernel to two
references: SDPA (transformers-style eager arithmetic for soft-capping) on the dense
contexts with a causal/window mask, which shares nothing with the kernel, and
`paged_attention_reference`, the same arithmetic through the block tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from triton.runtime import interpreter

from bitserve.llm import triton_attention as ta
from bitserve.llm.attention import write_kv

# tests/conftest.py turns the interpreter on before triton is imported; with
# TRITON_INTERPRET=0 on a GPU machine the same checks run the compiled kernels on cuda.
DEVICE = "cpu" if ta._INTERPRET else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

_patch_tensor = interpreter._patch_lang_tensor


def _patch_tensor_numpy24(tensor, scope):
    """triton 3.6's interpreter turns a scalar (a 1-element array) into a loop bound with
    int(array), which numpy >= 2.4 refuses; later triton uses .item() the same way."""
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


@pytest.fixture(scope="module", autouse=True)
def numpy24_interpreter():
    with mock.patch.object(interpreter, "_patch_lang_tensor", _patch_tensor_numpy24):
        yield


@pytest.fixture(autouse=True)
def every_block_returns():
    """Overrides conftest's per-test KV-pool check: no engine here (and no gc.collect)."""
    yield


@dataclass
class Case:
    q: torch.Tensor  # [T + 1, Hq, D]: the last row is in no sequence
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    rows: torch.Tensor  # int32 [B], shuffled
    block_tables: torch.Tensor  # int32 [B, W]
    context_lens: torch.Tensor  # int32 [B]
    dense: list  # per sequence: (k [Hkv, L, D], v, rows [n], positions [n])
    # The same step per sequence (paged_prefill_triton): rows of sequence s are
    # query_start[s] .. query_start[s + 1] - 1.
    query_start: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    seq_tables: torch.Tensor  # int32 [S, W]


def build(seqs, hkv=2, group=2, d=32, bs=4, dtype=torch.float32, q_scale=1.0, seed=0):
    """seqs: (cached, new) per sequence; the pool holds all cached + new keys (the step's
    own K/V are written before attention), the batch has one row per new token."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    k_pool = torch.full((hkv, num_blocks, bs, d), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()
    width = max(need)
    total = sum(n for _, n in seqs)
    q = (torch.randn(total + 1, hkv * group, d, generator=g) * q_scale).to(dtype)
    dense, tables, lens, row_ids, used, row = [], [], [], [], 0, 0
    seq_tables = []
    for (cached, new), nb in zip(seqs, need, strict=True):
        blocks = perm[used : used + nb]
        used += nb
        length = cached + new
        k = torch.randn(hkv, length, d, generator=g).to(dtype)
        v = torch.randn(hkv, length, d, generator=g).to(dtype)
        j = torch.arange(length)
        k_pool[:, blocks[j // bs], j % bs] = k
        v_pool[:, blocks[j // bs], j % bs] = v
        positions = torch.arange(cached, length)
        seq_rows = torch.arange(row, row + new)
        row += new
        dense.append((k, v, seq_rows, positions))
        table = torch.zeros(width, dtype=torch.int32)
        table[:nb] = blocks.to(torch.int32)
        tables += [table] * new
        seq_tables.append(table)
        lens += (positions + 1).tolist()
        row_ids += seq_rows.tolist()
    order = torch.randperm(total, generator=g)  # rows[b] != b: the kernel must use rows
    rows = torch.tensor(row_ids, dtype=torch.int32)[order]
    tables = torch.stack(tables)[order]
    lens = torch.tensor(lens, dtype=torch.int32)[order]
    query_start = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    per_seq = (query_start.to(torch.int32), seq_lens, torch.stack(seq_tables))
    on = [t.to(DEVICE) for t in (q, k_pool, v_pool, rows, tables, lens, *per_seq)]
    return Case(*on[:6], dense, *on[6:])


def dense_attention(case: Case, scale, window=0, softcap=0.0) -> torch.Tensor:
    """Every new token of every sequence against its dense context, fp32: SDPA with a
    causal (and window) mask, or eager scores -> cap * tanh(s / cap) -> mask -> softmax."""
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    for k, v, rows, positions in case.dense:
        k, v = k.float(), v.float()
        q = case.q.cpu()[rows].float().transpose(0, 1)  # [Hq, n, D]
        key_pos = torch.arange(k.shape[1])[None, :]
        mask = key_pos <= positions[:, None]
        if window:
            mask &= key_pos > positions[:, None] - window
        if softcap:
            group = q.shape[0] // k.shape[0]
            keys, values = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = q @ keys.transpose(1, 2) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ values
        else:
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            )[0]
        out[rows] = o.transpose(0, 1)
    return out


SENTINEL = 7.0


def run(fn, case: Case, scale, **kw) -> torch.Tensor:
    out = torch.full_like(case.q, SENTINEL)
    fn(case.q, out, case.rows, case.k_pool, case.v_pool, case.block_tables, case.context_lens,
       scale, **kw)  # fmt: skip
    return out.cpu()


MIXED = [(7, 1), (0, 6), (10, 5), (21, 1), (0, 1)]  # decodes, fresh and cached chunks

CASES = {
    "decode": dict(seqs=[(5, 1), (12, 1), (30, 1)]),
    "chunked_prefill": dict(seqs=[(0, 9), (0, 3)]),
    "prefix_cached": dict(seqs=[(13, 6)]),
    "mixed": dict(seqs=MIXED),
    "mixed_tile64": dict(seqs=MIXED, tile=64),  # the kernel's default tile: one per row
    "window": dict(seqs=MIXED, window=5),
    "softcap": dict(seqs=MIXED, softcap=4.0, scale=1.0),
    "window_softcap_split": dict(seqs=[(30, 1), (3, 6)], window=11, softcap=3.0, splits=3),
    "split_k": dict(seqs=[(37, 1), (0, 5), (20, 3)], splits=4),
    "mha": dict(seqs=MIXED, group=1),
    "gqa4": dict(seqs=MIXED, group=4, hkv=1),
    "gqa3_dim24": dict(seqs=MIXED, group=3, d=24),
    "block16": dict(seqs=MIXED, bs=16),
    "block32": dict(seqs=[(40, 1), (5, 12)], bs=32, window=10),  # a tile within a block
    "bf16": dict(seqs=MIXED, dtype=torch.bfloat16),
    "fp16_window_softcap": dict(seqs=MIXED, dtype=torch.float16, window=6, softcap=4.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_references(name):
    spec = dict(CASES[name])
    seqs = spec.pop("seqs")
    scale = spec.pop("scale", 32**-0.5)
    attn = {k: spec.pop(k) for k in ("window", "softcap") if k in spec}
    # 16-key tiles: several per row, so the online softmax's rescaling is exercised.
    launch = {
        "tile": spec.pop("tile", 16),
        **({"splits": spec.pop("splits")} if "splits" in spec else {}),
    }
    case = build(seqs, **spec)
    got = run(ta.paged_attention_triton, case, scale, **attn, **launch)
    ref = run(ta.paged_attention_reference, case, scale, **attn)
    dense = dense_attention(case, scale, **attn)

    low = case.q.dtype != torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=2e-5, rtol=1e-5)
    assert torch.equal(got[-1], torch.full_like(got[-1], SENTINEL)), "wrote a row not listed"
    assert not got.isnan().any()
    torch.testing.assert_close(got[:-1].float(), ref[:-1].float(), **tol)
    torch.testing.assert_close(got[:-1].float(), dense[:-1], **tol)
    torch.testing.assert_close(ref[:-1].float(), dense[:-1], **tol)
    # The case exercises what it names: without its window / cap the answer differs.
    for key in attn:
        plain = dense_attention(case, scale, **{k: v for k, v in attn.items() if k != key})
        assert (plain[:-1] - dense[:-1]).abs().max() > 0.05, f"{key} changes nothing here"


PREFILL_CASES = [
    "chunked_prefill", "prefix_cached", "mixed", "window", "softcap", "gqa3_dim24", "gqa4",
    "block32", "bf16", "fp16_window_softcap",
]  # fmt: skip


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_kernel_matches_references(name):
    """paged_prefill_triton (query blocks of 4 rows per sequence, several per chunk and a
    partial last one) against the dense references, on the row kernel's cases."""
    spec = dict(CASES[name])
    seqs = spec.pop("seqs")
    scale = spec.pop("scale", 32**-0.5)
    attn = {k: spec.pop(k) for k in ("window", "softcap") if k in spec}
    spec.pop("tile", None)
    case = build(seqs, **spec)
    out = torch.full_like(case.q, SENTINEL)
    max_new = max(n for _, n in seqs)
    ta.paged_prefill_triton(case.q, out, case.query_start, case.seq_lens, case.k_pool,
                            case.v_pool, case.seq_tables, scale, max_new, block_q=4, tile=16,
                            **attn)  # fmt: skip
    got = out.cpu()
    dense = dense_attention(case, scale, **attn)
    low = case.q.dtype != torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=2e-5, rtol=1e-5)
    assert torch.equal(got[-1], torch.full_like(got[-1], SENTINEL)), "wrote a row not listed"
    torch.testing.assert_close(got[:-1].float(), dense[:-1], **tol)


def test_splits_change_nothing():
    """Split-K is a reordering of one sum: 1 and 3 splits agree to rounding."""
    case = build([(37, 1), (9, 3)], seed=3)
    outs = [run(ta.paged_attention_triton, case, 0.2, window=30, splits=s, tile=16) for s in (1, 3)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-5)


STORES = [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("dtype", "pool_dtype"), STORES)
def test_store_kv_matches_write_kv(dtype, pool_dtype):
    """write_kv_triton puts K/V where attention.write_kv does (k, v strided views of a
    fused qkv, converted to the pool's dtype); a negative slot (a padding row) is skipped."""
    g = torch.Generator().manual_seed(1)
    hkv, nb, bs, d, t = 2, 6, 4, 24, 7
    qkv = torch.randn(t + 1, 3 * hkv, d, generator=g).to(DEVICE, dtype)
    k, v = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]
    slots = torch.randperm(nb * bs, generator=g)[: t + 1].to(DEVICE)
    slots[3] = -1
    pools = [torch.zeros(hkv, nb, bs, d, dtype=pool_dtype, device=DEVICE) for _ in range(4)]
    ours, theirs = tuple(pools[:2]), tuple(pools[2:])
    ta.write_kv_triton(ours, k, v, slots)
    keep = slots >= 0
    write_kv(theirs, k[keep], v[keep], slots[keep])
    if dtype == pool_dtype or DEVICE == "cuda":
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    else:  # the interpreter rounds fp32 -> bf16 toward zero, torch and GPUs to nearest
        torch.testing.assert_close(ours, theirs, atol=0, rtol=2**-7)
    assert ours[0].abs().sum() > 0


def test_bad_metadata_is_refused():
    case = build([(3, 2)])
    out = torch.empty_like(case.q)
    args = [case.q, out, case.rows, case.k_pool, case.v_pool, case.block_tables]
    with pytest.raises(ValueError, match="rows must be int32"):
        ta.paged_attention_triton(*args[:2], case.rows.long(), *args[3:], case.context_lens, 1.0)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        pool = torch.zeros(2, 4, 3, 32, device=DEVICE)
        ta.paged_attention_triton(*args[:3], pool, pool, *args[5:], case.context_lens, 1.0)
    with pytest.raises(ValueError, match="query_start must be int32"):
        starts = case.query_start.long()
        ta.paged_prefill_triton(case.q, out, starts, case.seq_lens, case.k_pool, case.v_pool,
                                case.seq_tables, 1.0, 2)  # fmt: skip


def test_available_only_with_a_gpu():
    """The interpreter is on here, yet `available()` says no: a CPU engine never takes
    the Triton path (the C kernels are the CPU's)."""
    assert ta.available() == torch.cuda.is_available()


def test_padding_rows_get_zeros():
    """A row with context_lens 0 (a CUDA graph's padding) reads nothing and gets 0."""
    case = build([(6, 1), (3, 2)])
    case.context_lens[1] = 0
    padded = int(case.rows[1])
    for splits in (1, 2):
        out = run(ta.paged_attention_triton, case, 0.3, splits=splits, tile=16)
        assert torch.equal(out[padded], torch.zeros_like(out[padded]))
        assert not out.isnan().any()


COMPILE_CHECK = [sys.executable, "tests/llm/triton_compile_check.py"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_check(*flags):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [*COMPILE_CHECK, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), done.stdout + done.stderr


def test_kernels_compile_for_sm90():
    """Triton's compiler (not the interpreter) builds the bf16 GQA/soft-cap/split-K step's
    kernels for an H100/H200 cubin: tests/llm/triton_compile_check.py."""
    compile_check()


@pytest.mark.slow
def test_every_variant_compiles_for_sm90():
    """fp32/fp16/bf16, head_dim 64-256, group 1-8, block 16-256, int args of 1."""
    compile_check("--all")
