"""Offline LLM throughput: bitserve's engine against transformers' static batching.

    .venv/bin/python -m bench.llm_throughput [--quick] [--threads 1]

A random-weight Llama-shaped model (~58M parameters: hidden 512, 8 layers, 8 heads,
intermediate 1408, vocab 32000) is built from a config into a temp dir. 256 requests
with input lengths uniform in [16, 512] and outputs uniform in [16, 256] (ignore_eos)
run through:
  - bitserve: `LLMEngine` continuous batching, paged KV cache;
  - transformers: `generate` on static batches in arrival order, left-padded, each
    batch running to its longest output; the best of a few batch sizes (picked on the
    first 64 requests) then runs all requests.
It also reports KV memory utilisation / waste and batch-1 decode time per step
against the memory-bandwidth bound (weight bytes read per step / bandwidth measured
here with a large torch sum, best of the probes just before and after the decode
timing, at the same thread count). bitserve runs its C decode kernels
(`bitserve/kernels`, single-threaded) when a C compiler is present;
`BITSERVE_NO_KERNELS=1` measures the pure-torch fallback. Prints a table, then one
JSON line.

`--architectures`: each dense family the engine serves (Llama, Qwen3, Gemma 2,
Gemma 3, Phi-3) at Llama's shape above (untied head, head_dim 64), batch-1 decode
ms/step and batch-32 decode tok/s (64-token prompts), and throughput per parameter
(tok/s x parameters) against Llama's; the five engines step in turn, one decode step
each, and each reports its median step. `--moe`: a Mixtral whose experts
(400 MB fp32) exceed the caches, batch-1 decode fp32 against int8 and int4 experts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from bitserve.llm.engine import LLMEngine
from bitserve.llm.sampling_params import SamplingParams

SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1408,
    vocab_size=32000,
)


FAMILIES = {  # same shape as SHAPE; each family's own switches at their defaults
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=64)),
    "gemma2": ("Gemma2Config", dict(head_dim=64, query_pre_attn_scalar=64)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=64, query_pre_attn_scalar=64)),
    "phi3": ("Phi3Config", {}),
}


def build_model(folder: Path, family: str = "llama") -> int:
    """A random-weight model of `family` at SHAPE, saved to `folder`; its parameter count."""
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        **SHAPE, **extra, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_requests(n: int, inputs: tuple[int, int], outputs: tuple[int, int], seed=0):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(*inputs))],
            rng.randint(*outputs),
        )
        for _ in range(n)
    ]


def measure_bandwidth() -> float:
    """Read bandwidth in bytes/s: the best of a few sums over 512 MiB (at the current
    torch thread count; the decode kernels are single-threaded, see --threads)."""
    x = torch.ones(128 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def run_bitserve(folder: Path, requests, max_num_batched_tokens: int) -> dict:
    engine = LLMEngine(
        folder,
        num_kv_blocks=None,
        max_num_seqs=256,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        kv_cache_memory=2 << 30,
    )
    for i, (prompt, out_len) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    produced, waste_allocated, waste_used, peak_usage, steps = 0, 0, 0, 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        produced += len(outputs)
        m = engine.metrics()
        waste_allocated += m.kv_slots_allocated
        waste_used += m.kv_slots_used
        peak_usage = max(peak_usage, m.kv_cache_usage)
        steps += 1
        if steps % 200 == 0:
            print(
                f"  bitserve: step {steps}, {produced} tokens, {m.num_requests_running} running",
                file=sys.stderr,
            )
    elapsed = time.perf_counter() - start
    return {
        "tok_s": produced / elapsed,
        "seconds": elapsed,
        "tokens": produced,
        "steps": steps,
        "kv_waste": 1 - waste_used / max(waste_allocated, 1),
        "kv_peak_usage": peak_usage,
        "kv_blocks": engine.block_manager.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_transformers(folder: Path, requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    useful, start = 0, time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(n for _, n in batch)
    elapsed = time.perf_counter() - start
    return {
        "tok_s": useful / elapsed,
        "seconds": elapsed,
        "tokens": useful,
        "batch_size": batch_size,
    }


def decode_step_time(folder: Path, steps: int) -> float:
    """Median seconds per decode step at batch 1 (after a 16-token prompt)."""
    engine = LLMEngine(folder, num_kv_blocks=64, max_model_len=1024)
    engine.add_request(
        "b1",
        list(range(3, 19)),
        SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True),
    )
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def weight_bytes_per_decode(folder: Path) -> int:
    """Bytes a decode step must read: every weight except the embedding table (one row)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            if "embed_tokens" not in name:
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * 4
    return total


def best_ms(fn, repeats: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 3)


def attention_case(seqs: int, length: int, heads: int = 8, dim: int = 64, bs: int = 16) -> dict:
    """Decode attention for `seqs` sequences of `length` tokens: ms per call."""
    import torch.nn.functional as F

    from bitserve import kernels
    from bitserve.llm.attention import GatherWorkspace, decode_attention

    nb = length // bs
    pool = torch.randn(heads, seqs * nb + 8, bs, dim)
    tables = torch.randperm(seqs * nb + 8)[: seqs * nb].view(seqs, nb)
    q = torch.randn(seqs, heads, dim)
    contiguous = torch.randn(seqs, heads, length, dim)
    ws = GatherWorkspace()
    flat_buf = torch.empty(heads, seqs * nb, bs, dim)
    mask = torch.ones(seqs, 1, 1, length, dtype=torch.bool)

    def contiguous_sdpa():
        F.scaled_dot_product_attention(q[:, :, None], contiguous, contiguous)

    def paged_per_seq():  # what bitserve runs: head-major pool, gather, SDPA per sequence
        for i in range(seqs):
            keys = ws.gather(pool, "keys", tables[i])
            values = ws.gather(pool, "values", tables[i])
            decode_attention(q[i : i + 1], keys, values, dim**-0.5)

    def paged_batched_masked():  # one gather for all sequences, padded SDPA with a mask
        torch.index_select(pool, 1, tables.flatten(), out=flat_buf)
        kv = flat_buf.view(heads, seqs, length, dim).transpose(0, 1)
        F.scaled_dot_product_attention(q[:, :, None], kv, kv, attn_mask=mask)

    result = {
        "seqs": seqs,
        "context": length,
        "contiguous_ms": best_ms(contiguous_sdpa),
        "paged_per_seq_ms": best_ms(paged_per_seq),
        "paged_batched_masked_ms": best_ms(paged_batched_masked),
    }
    k = kernels.get()
    if k is not None:  # what bitserve runs when the C kernels are built
        huge_pool = kernels.zeros_huge_pages(tuple(pool.shape))
        huge_pool.copy_(pool)
        rows = torch.arange(seqs, dtype=torch.int32)
        lens = torch.full((seqs,), length, dtype=torch.int32)
        tables32, out = tables.int(), torch.empty_like(q)

        def paged_kernel():
            k.paged_decode(q, out, rows, huge_pool, huge_pool, tables32, lens, dim**-0.5)

        result["paged_kernel_ms"] = best_ms(paged_kernel)
    return result


def attention_alternatives() -> list[dict]:
    """Decode attention (q_len 1, 8 heads x 64, fp32, block 16), min of 20 calls."""
    results = []
    for seqs, length in [(1, 512), (8, 512), (32, 512), (8, 2048)]:
        results.append(attention_case(seqs, length))
        print(results[-1], file=sys.stderr)
    return results


def interleaved_steps(folders: dict[str, Path], batch: int, steps: int) -> dict[str, float]:
    """Median seconds per decode step of each model at `batch` sequences, the models
    stepping in turn (one step each, round after round): on a shared machine a burst
    of load then hits every model alike instead of deciding the comparison."""
    engines = {}
    for family, folder in folders.items():
        engine = LLMEngine(folder, num_kv_blocks=batch * 16, max_model_len=1024)
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), list(range(3 + i, 3 + i + 64)), params)
        engine.step()  # every prefill in one step
        engine.step()  # and a first decode, off the clock
        engines[family] = engine
    times: dict[str, list[float]] = {family: [] for family in engines}
    for _ in range(steps):
        for family, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[family].append(time.perf_counter() - start)
    return {family: median(t) for family, t in times.items()}


def architectures(quick: bool) -> None:
    """Batch-1 ms/step and batch-32 decode tok/s of each family at the same shape,
    measured interleaved (`interleaved_steps`)."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = {family: Path(tmp) / family for family in FAMILIES}
        params = {family: build_model(folder, family) for family, folder in folders.items()}
        one = interleaved_steps(folders, 1, 32 if quick else 128)
        many = interleaved_steps(folders, 8 if quick else 32, 16 if quick else 64)
    rows = [
        dict(family=f, params=params[f], step_ms=one[f] * 1e3, tok_s=(8 if quick else 32) / many[f])
        for f in FAMILIES
    ]
    base = rows[0]
    print(f"{'family':<8} {'params M':>9} {'b1 ms/step':>11} {'b1 vs llama':>12} "
          f"{'b32 tok/s':>10} {'b32 vs llama':>13}")  # fmt: skip
    for r in rows:  # per parameter: a bigger model may be slower in proportion
        r["b1_vs_llama"] = (base["step_ms"] / base["params"]) / (r["step_ms"] / r["params"])
        r["b32_vs_llama"] = (r["tok_s"] * r["params"]) / (base["tok_s"] * base["params"])
        print(
            f"{r['family']:<8} {r['params'] / 1e6:>9.1f} {r['step_ms']:>11.2f} "
            f"{r['b1_vs_llama']:>11.0%} {r['tok_s']:>10.0f} {r['b32_vs_llama']:>12.0%}"
        )
    print(json.dumps({"bench": "llm_architectures", "quick": quick, "results": rows}))


def moe_quantized(quick: bool) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    from bitserve.quantize.command import _quantize_llm
    from bitserve.quantize.folders import Source

    hidden, inter = (512, 1024) if quick else (1024, 2048)
    config = MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=1024,
    )  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "fp32"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(source)
        folders = {"fp32": source}
        for method in ("int8", "int4"):
            folders[method] = Path(tmp) / method
            _quantize_llm(Source(source, "llm"), folders[method], method, 32, 6.0, None, 0, None)
        for name, folder in folders.items():
            results[name] = decode_step_time(folder, 16 if quick else 64) * 1e3
    experts = 2 * 8 * 3 * hidden * inter * 4
    print(f"Mixtral, 2 layers x 8 experts, {experts / 2**20:.0f} MiB of fp32 experts, batch 1:")
    for name, ms in results.items():
        print(f"  {name:<5} {ms:7.2f} ms/step  {results['fp32'] / ms:5.2f}x fp32")
    print(json.dumps({"bench": "llm_moe_quant", "expert_bytes": experts, "ms_per_step": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="8,16,32,64")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument(
        "--attention",
        action="store_true",
        help="only compare the paged decode-attention alternatives",
    )
    parser.add_argument("--architectures", action="store_true", help="decode speed per family")
    parser.add_argument("--moe", action="store_true", help="MoE decode: fp32, int8, int4 experts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.architectures:
        return architectures(args.quick)
    if args.moe:
        return moe_quantized(args.quick)
    if args.attention:
        print(json.dumps({"bench": "llm_attention", "results": attention_alternatives()}))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        requests = make_requests(24, (16, 128), (8, 32))
        batch_sizes, calibration = [4, 8], 16
    else:
        requests = make_requests(256, (16, 512), (16, 256))
        batch_sizes, calibration = [int(b) for b in args.batch_sizes.split(",")], 64

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params = build_model(folder)
        # The bound uses the best read bandwidth seen just before and just after the
        # decode timing, at the same thread count: on a shared box a single probe can
        # land in a busy moment and flatter the ratio.
        bandwidth = measure_bandwidth()
        weight_bytes = weight_bytes_per_decode(folder)
        step = decode_step_time(folder, 16 if args.quick else 64)
        bandwidth = max(bandwidth, measure_bandwidth())
        bound = weight_bytes / bandwidth
        print(
            f"model {params / 1e6:.1f}M params; bandwidth {bandwidth / 1e9:.1f} GB/s; "
            f"batch-1 decode {step * 1e3:.2f} ms vs bound {bound * 1e3:.2f} ms",
            file=sys.stderr,
        )

        ours = run_bitserve(folder, requests, args.max_num_batched_tokens)
        print(f"bitserve: {ours['tok_s']:.1f} tok/s", file=sys.stderr)
        sample = requests[:calibration]
        trials = {b: run_transformers(folder, sample, b)["tok_s"] for b in batch_sizes}
        best = max(trials, key=trials.get)
        print(f"transformers calibration (tok/s by batch size): {trials}", file=sys.stderr)
        theirs = run_transformers(folder, requests, best)

    rows = [
        ("requests", len(requests), ""),
        ("model parameters (M)", f"{params / 1e6:.1f}", ""),
        (
            "bitserve output tok/s",
            f"{ours['tok_s']:.1f}",
            f"{ours['seconds']:.1f} s, {ours['steps']} steps",
        ),
        (
            "transformers output tok/s",
            f"{theirs['tok_s']:.1f}",
            f"static batch {best}, {theirs['seconds']:.1f} s",
        ),
        ("speed-up", f"{ours['tok_s'] / theirs['tok_s']:.2f}x", "goal >= 2x"),
        (
            "KV waste (allocated - used)",
            f"{ours['kv_waste'] * 100:.2f}%",
            "slots summed over all steps; goal <= 4%",
        ),
        (
            "KV peak block usage",
            f"{ours['kv_peak_usage'] * 100:.1f}%",
            f"{ours['kv_blocks']} blocks, {ours['preemptions']} preemptions",
        ),
        ("threads", args.threads, "torch.set_num_threads, both engines and the bound"),
        ("memory bandwidth (GB/s)", f"{bandwidth / 1e9:.1f}", "torch sum, 512 MiB, best"),
        ("batch-1 decode ms/step", f"{step * 1e3:.2f}", f"median; bound {bound * 1e3:.2f} ms"),
        ("batch-1 decode vs bound", f"{bound / step * 100:.0f}%", "goal >= 75%"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value!s:>10}  {note}")
    print(
        json.dumps(
            {
                "bench": "llm_throughput",
                "quick": args.quick,
                "threads": args.threads,
                "requests": len(requests),
                "bitserve_tok_s": round(ours["tok_s"], 2),
                "transformers_tok_s": round(theirs["tok_s"], 2),
                "transformers_batch_size": best,
                "transformers_calibration_tok_s": {str(k): round(v, 2) for k, v in trials.items()},
                "speedup": round(ours["tok_s"] / theirs["tok_s"], 3),
                "kv_waste": round(ours["kv_waste"], 4),
                "kv_peak_usage": round(ours["kv_peak_usage"], 4),
                "bandwidth_gb_s": round(bandwidth / 1e9, 2),
                "decode_ms_batch1": round(step * 1e3, 3),
                "decode_bound_ms": round(bound * 1e3, 3),
                "decode_vs_bound": round(bound / step, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
