"""Compile the Triton attention kernels for an H100/H200 (sm_90) with no GPU here.

The interpreter runs the kernels' arithmetic but not Triton's compiler, where shape and
type rules fail (tl.dot operands, constexpr branches, an int argument of 1 specialised
into a constexpr). This launches the wrappers on CPU tensors with `_launch` replaced by
what `kernel[grid](...)` does up to the launch itself: bind and specialise the arguments
for a cuda sm_90 target, then compile to a cubin with the wheel's ptxas.

    python tests/llm/triton_compile_check.py [--all]

(tests/llm/test_triton_attention.py runs it; the compiled kernels land in Triton's
cache, so a second run takes seconds.)
"""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: real JIT functions
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from bitserve.llm import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
SMEM_LIMIT = 227 * 1024  # per block on sm_90


def compile_launch(kernel, grid, *args, **constexprs) -> None:
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, specialization, options = binder(*args, **constexprs)
    options, signature, consts, attrs = kernel._pack_args(
        BACKEND, constexprs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, consts, attrs)
    compiled = triton.compile(src, target=TARGET, options=options.__dict__)
    shared = compiled.metadata.shared
    names = ", ".join(f"{k}={v}" for k, v in constexprs.items())
    print(f"{kernel.fn.__name__}: shared {shared} B, {names}", flush=True)
    assert "cubin" in compiled.asm and shared <= SMEM_LIMIT


def attention(dtype, hkv, group, d, bs, width, rows=3, **kw) -> None:
    q = torch.zeros(rows, hkv * group, d, dtype=dtype)
    pool = torch.zeros(hkv, rows * width, bs, d, dtype=dtype)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    index = torch.zeros(rows, dtype=torch.int32)
    ta.paged_attention_triton(q, q.clone(), index, pool, pool, tables, index, 0.1, **kw)


def prefill(dtype, hkv, group, d, bs, width, seqs=2, **kw) -> None:
    q = torch.zeros(seqs * 8, hkv * group, d, dtype=dtype)
    pool = torch.zeros(hkv, seqs * width, bs, d, dtype=dtype)
    tables = torch.zeros(seqs, width, dtype=torch.int32)
    starts = torch.arange(0, 8 * seqs + 1, 8, dtype=torch.int32)
    lens = torch.full((seqs,), 8, dtype=torch.int32)
    ta.paged_prefill_triton(q, q.clone(), starts, lens, pool, pool, tables, 0.1, 8, **kw)


def store(dtype, hkv, d, bs) -> None:
    k = torch.zeros(4, hkv, d, dtype=dtype)
    pool = torch.zeros(hkv, 8, bs, d, dtype=dtype)
    ta.write_kv_triton((pool, pool), k, k, torch.zeros(4, dtype=torch.int64))


def main(everything: bool) -> None:
    ta._launch = compile_launch
    # What a bf16 Llama/Gemma-2 step on an H200 uses: GQA 4, D 128, 16-token blocks,
    # soft-capping and split-K (both kernels), a windowed prefill, and the store.
    attention(torch.bfloat16, 2, 4, 128, 16, 8, softcap=30.0, splits=4)
    prefill(torch.bfloat16, 2, 4, 128, 16, 8, softcap=30.0, window=4096)
    store(torch.bfloat16, 2, 128, 16)
    if everything:
        # fp32 (IEEE dots), MHA, one-block tables and window=1: stride and window become
        # constexpr 1 (Triton specialises an int argument of 1).
        attention(torch.float32, 4, 1, 64, 16, 1, window=1, splits=1)
        attention(torch.float16, 1, 8, 256, 32, 4, window=4096, splits=1)  # D 256
        attention(torch.bfloat16, 4, 7, 80, 256, 2, splits=2)  # group 7, D 80, 256 blocks
        attention(torch.bfloat16, 8, 8, 128, 16, 64, splits=1, tile=32)
        prefill(torch.float32, 4, 1, 64, 16, 1, window=1)
        prefill(torch.float16, 1, 8, 256, 32, 4)
        prefill(torch.bfloat16, 4, 7, 80, 256, 2, block_q=16)
        store(torch.float32, 1, 80, 256)
    print("ok")


if __name__ == "__main__":
    main("--all" in sys.argv)
