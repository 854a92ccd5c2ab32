"""The Triton paged-attention kernels against the torch GPU path they replace.

    python -m bench.triton_attention [--cpu]

One layer's attention of a ~1B Llama (32 query heads, 8 KV heads, head_dim 64, bf16,
16-token blocks), the step's K/V store included, through:
  - triton: `write_kv_triton`, then `paged_attention_triton` over every row (the C
    kernel's contract) and, for prefill chunks, `paged_prefill_triton`;
  - torch: `attention.paged_attention` as a GPU runs it today: `write_kv`, then per
    sequence a gather of its context (`index_select`) and SDPA.
Times are medians of `triton.testing.do_bench` (CUDA events); ratios are torch / triton
from the same run, and max diff is triton's largest deviation from torch's output on the
same inputs. Decode cases also give the K/V bytes read per second against a
device-to-device copy measured in the same run (bytes read + written per second).
`--cpu`: tiny shapes through Triton's interpreter, one untimed-quality run each, to
exercise the script here. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported

import torch

from bitserve.llm import triton_attention as ta
from bitserve.llm.attention import AttentionMetadata, GatherWorkspace, SeqSlice, paged_attention

CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
HQ, HKV, D, BS = (4, 2, 32, 4) if CPU else (32, 8, 64, 16)
DTYPE = torch.float32 if CPU else torch.bfloat16
if CPU:  # triton 3.6's interpreter and numpy >= 2.4: see tests/llm/test_triton_attention.py
    from triton.runtime import interpreter

    _patch = interpreter._patch_lang_tensor

    def _patch_numpy24(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_numpy24


def timed(fn) -> float:
    """Median ms of fn (one plain run under the interpreter)."""
    if CPU:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def step(seqs: list[tuple[int, int]]):
    """(cached, new) per sequence -> the step's tensors for both paths."""
    g = torch.Generator().manual_seed(0)
    need = [-(-(c + n) // BS) for c, n in seqs]
    blocks = torch.randperm(sum(need) + 1, generator=g)
    k_pool = torch.randn(HKV, len(blocks), BS, D, generator=g).to(DEVICE, DTYPE)
    cache = (k_pool, k_pool.clone())
    total = sum(n for _, n in seqs)
    q = torch.randn(total, HQ, D, generator=g).to(DEVICE, DTYPE)
    k, v = (torch.randn(total, HKV, D, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    width, used, row = max(need), 0, 0
    slots, slices, row_tables, row_lens, seq_tables = [], [], [], [], []
    for (cached, new), nb in zip(seqs, need, strict=True):
        table = blocks[used : used + nb]
        used += nb
        positions = torch.arange(cached, cached + new)
        slots.append(table[positions // BS] * BS + positions % BS)
        slices.append(SeqSlice(row, row + new, cached + new, table.to(DEVICE)))
        padded = torch.zeros(width, dtype=torch.int32)
        padded[:nb] = table.to(torch.int32)
        row_tables += [padded] * new
        row_lens.append(positions + 1)
        seq_tables.append(padded)
        row += new
    slot_mapping = torch.cat(slots).to(DEVICE)
    meta = AttentionMetadata(slot_mapping, slices, GatherWorkspace())
    rows = torch.arange(total, dtype=torch.int32, device=DEVICE)
    tables = torch.stack(row_tables).to(DEVICE)
    lens = torch.cat(row_lens).to(DEVICE, torch.int32)
    starts = torch.tensor([0] + [n for _, n in seqs]).cumsum(0).to(DEVICE, torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE)
    per_seq = (starts, seq_lens, torch.stack(seq_tables).to(DEVICE))
    return q, k, v, cache, meta, (rows, tables, lens), per_seq


def case(name: str, seqs: list[tuple[int, int]]) -> dict:
    q, k, v, cache, meta, by_row, per_seq = step(seqs)
    scale = D**-0.5
    out = torch.empty_like(q)

    def rows_kernel():
        ta.write_kv_triton(cache, k, v, meta.slot_mapping)
        ta.paged_attention_triton(q, out, by_row[0], *cache, *by_row[1:], scale)

    def prefill_kernel():
        ta.write_kv_triton(cache, k, v, meta.slot_mapping)
        longest = max(n for _, n in seqs)
        ta.paged_prefill_triton(q, out, *per_seq[:2], *cache, per_seq[2], scale, longest)

    result = {"case": name, "rows": q.shape[0]}
    want = paged_attention(q, k, v, cache, meta, scale).float()
    rows_kernel()
    diff = (out.float() - want).abs().max().item()
    if any(n > 1 for _, n in seqs):
        prefill_kernel()
        diff = max(diff, (out.float() - want).abs().max().item())
    result["max_abs_diff"] = diff  # triton against torch, same inputs
    result["torch_ms"] = timed(lambda: paged_attention(q, k, v, cache, meta, scale))
    result["triton_rows_ms"] = timed(rows_kernel)
    if any(n > 1 for _, n in seqs):
        result["triton_prefill_ms"] = timed(prefill_kernel)
    best = min(result.get("triton_prefill_ms", 1e30), result["triton_rows_ms"])
    result["torch_over_triton"] = result["torch_ms"] / best
    if all(n == 1 for _, n in seqs):  # decode: K and V of every context read once
        kv_bytes = 2 * sum(c + 1 for c, _ in seqs) * HKV * D * q.element_size()
        result["kv_TBps"] = kv_bytes / (result["triton_rows_ms"] * 1e-3) / 1e12
    return result


def copy_tbps() -> float:
    if CPU:
        return None
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def main() -> None:
    if not CPU and not ta.available():
        raise SystemExit("needs triton and a CUDA GPU (or --cpu)")
    if CPU:
        cases = {"decode b4 ctx 20": [(19, 1)] * 4, "prefill 12 after 8": [(8, 12)]}
    else:
        decodes = [(1, 1024), (1, 8192), (16, 1024), (64, 1024), (256, 1024), (64, 4096)]
        cases = {f"decode b{b} ctx {c}": [(c - 1, 1)] * b for b, c in decodes}
        cases |= {
            "prefill 512 fresh": [(0, 512)],
            "prefill 512 after 1536": [(1536, 512)],
            "prefill 8 x 256 fresh": [(0, 256)] * 8,
            "mixed 32 decodes + 512 chunk": [(1023, 1)] * 32 + [(512, 512)],
        }
    results = [case(name, seqs) for name, seqs in cases.items()]
    copy = copy_tbps()
    print(f"device: {torch.cuda.get_device_name() if not CPU else 'cpu (interpreter)'}")
    print(f"copy bandwidth (read + write): {copy or float('nan'):.2f} TB/s")
    head = f"{'case':32} {'torch ms':>9} {'rows ms':>9} {'prefill ms':>10} {'ratio':>7}"
    print(head + f" {'KV TB/s':>8} {'max diff':>9}")
    for r in results:
        prefill = r.get("triton_prefill_ms", float("nan"))
        print(
            f"{r['case']:32} {r['torch_ms']:9.3f} {r['triton_rows_ms']:9.3f} {prefill:10.3f}"
            f" {r['torch_over_triton']:7.2f} {r.get('kv_TBps', float('nan')):8.2f}"
            f" {r['max_abs_diff']:9.2e}"
        )
    print(json.dumps({"copy_TBps": copy, "cases": results}))


if __name__ == "__main__":
    main()
