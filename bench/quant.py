"""Quantization: weight memory and decode speed of fp32, bf16, int8, int4 in one run.

    .venv/bin/python -m bench.quant [--quick] [--threads 1] [--tokens 64]
        [--model HF_FOLDER] [--variants fp32,bf16,int8,int4]

The 58M random Llama-shaped benchmark model of bench/llm_throughput.py (hidden 512,
8 layers, vocab 32000, untied embeddings) is built into a temp dir (or --model: any
Llama-shaped HF folder, e.g. bench/llm_serving.py's 1b), then quantized with
`bitserve quantize`'s own functions (int8: per-channel int8 weights; int4: group 32).
Each variant loads through the engine (`LLMEngine`, as serve and LLM() do) and decodes
greedily at batch 1 and batch 16 (short prompts, `ignore_eos`); decode tok/s
counts the tokens after each request's first one, over the time after the prefill
step. The variants take turns within each repeat and the best run counts, so that a
busy spell on a shared machine does not land on one variant only. Weight memory is
what the loaded model holds (parameters, buffers, packed kernel weights; each storage
once). Ratios are against fp32 measured in this run. Batch-1 decode is bound by reading
the weights: "b1 GB/s" is the bytes a step reads (every weight but the embedding table,
of which it reads one row) times the steps per second, and "x read" that against a
plain read (torch's sum, these threads, best of 5) of as many bytes, measured here.
`--size 246m` builds the random 246M Llama instead (hidden 1024, 16 layers, GQA 16/4,
intermediate 2816). Variants beyond those four (issue 38): `bf16-widen` (bf16 weights
through the widen + FMA loop a CPU without avx512_bf16 runs; `bf16` is vdpbf16ps where
the CPU has it), `awq` and `gptq` (4-bit group-128 checkpoints written here in AutoAWQ's
GEMM and AutoGPTQ's layouts, GPTQ with act-order; fp32 scales on the int4 kernel; their
LM head stays as the checkpoint has it, fp16, here fp32, or bf16 in `awq-bf16`, served
with dtype bfloat16) and `int4-g128` (bitserve's own int4 at group 128, bf16 scales).
`--scales` prices fp32 scales against bf16 ones on the int4 kernel alone. The CPU's
model name and whether it has avx512_bf16 go in the JSON line.
Goals (issue 8): int8 weights <= 0.27x fp32, int8 batch-1 decode >= 2x fp32, int4 >= 3x;
(issue 23, at ~1B) fp32 batch-1 >= 0.9 of the read, int8 >= 1.8x and int4 >= 2.5x fp32.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.llm_throughput import SHAPE, build_model
from bitserve import kernels
from bitserve.llm.config import EngineConfig
from bitserve.llm.engine import LLMEngine
from bitserve.llm.models import load_model
from bitserve.llm.quant.quantize import (
    quantize_model,
    save_weights,
    weight_bytes,
    write_config,
)
from bitserve.llm.sampling_params import SamplingParams

VARIANTS = ("fp32", "bf16", "int8", "int4", "bf16-widen", "awq", "gptq", "int4-g128", "awq-bf16")
OWN = {"int8": ("int8", 32), "int4": ("int4", 32), "int4-g128": ("int4", 128)}
SIZE_246M = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816, vocab_size=32000)  # fmt: skip


def make_variants(root: Path, model: Path | None, variants) -> dict[str, tuple[Path, str]]:
    """variant -> (folder, engine dtype)."""
    fp32 = model
    if fp32 is None:
        fp32 = root / "fp32"
        build_model(fp32)
    folders = {"fp32": (fp32, "float32"), "bf16": (fp32, "bfloat16")}
    folders["bf16-widen"] = (fp32, "bfloat16")
    for name in [v for v in OWN if v in variants]:
        method, group = OWN[name]
        model = load_model(EngineConfig(model=fp32, device="cpu", num_kv_blocks=1))
        qconfig = quantize_model(model, method, group_size=group)
        out = root / name
        out.mkdir()
        write_config(fp32, out, qconfig)
        save_weights(model, out, qconfig)
        folders[name] = (out, "float32")
        del model
    for name in [v for v in ("awq", "gptq") if v in variants or f"{v}-bf16" in variants]:
        write_checkpoint(fp32, root / name, name)
        folders[name] = (root / name, "float32")
        folders[f"{name}-bf16"] = (root / name, "bfloat16")  # its fp16 LM head in bf16
    return folders


def build_246m(folder: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **SIZE_246M, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


# -- AWQ / GPTQ checkpoints (bitserve/llm/quant/checkpoints.py has the layouts) ----------------
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack8(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes -> int32 [...], code j in bits 4j .. 4j + 3."""
    value = sum(codes[..., j].long() << (4 * j) for j in range(8))
    return (value - (value >= 2**31).long() * 2**32).to(torch.int32)


def quantize_4bit(w: torch.Tensor, perm: torch.Tensor, group: int):
    """Min/max 4-bit per group of `group` columns in `perm`'s order -> q [out, in] (input
    order), zero [out, groups], scale fp16 [out, groups]."""
    n, k = w.shape
    wp = w[:, perm].view(n, k // group, group)
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    qp = (torch.round(wp / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long()
    q = torch.empty(n, k, dtype=torch.long)
    q[:, perm] = qp.view(n, k)
    return q, zero, scale


def write_checkpoint(fp32: Path, out: Path, method: str, group: int = 128) -> None:
    """A 4-bit group-128 AWQ (GEMM) or GPTQ (v1, act-order: each layer's inputs in a random
    order, shared by the layers that read the same input) checkpoint of `fp32`."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    state: dict[str, torch.Tensor] = {}
    for file in sorted(fp32.glob("*.safetensors")):
        state |= load_file(str(file))
    gen, orders = torch.Generator().manual_seed(0), {}
    for name in [n for n in state if n.rsplit(".", 2)[-2] in LINEARS]:
        w = state.pop(name).float()
        n, k = w.shape
        prefix = name.removesuffix(".weight")
        key = (prefix.rsplit(".", 1)[0], k)  # q/k/v and gate/up share their input
        perm = orders.setdefault(key, torch.randperm(k, generator=gen))
        if method == "awq":
            perm = torch.arange(k)
        q, zero, scale = quantize_4bit(w, perm, group)
        if method == "awq":
            parts = {"qweight": pack8(q.t().reshape(k, n // 8, 8)[..., AWQ_ORDER]),
                     "qzeros": pack8(zero.t().reshape(-1, n // 8, 8)[..., AWQ_ORDER])}  # fmt: skip
        else:
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // group).int()
            parts = {"qweight": pack8(q.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
                     "qzeros": pack8(((zero.t() - 1) & 15).reshape(-1, n // 8, 8)),
                     "g_idx": g_idx}  # fmt: skip
        parts["scales"] = scale.t()
        state |= {f"{prefix}.{part}": t.contiguous() for part, t in parts.items()}
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()},
              str(out / "model.safetensors"))  # fmt: skip
    qconfig = {"quant_method": method, "bits": 4, "group_size": group}
    qconfig |= {"version": "gemm", "zero_point": True} if method == "awq" else {"desc_act": True}
    config = json.loads((fp32 / "config.json").read_text())
    config |= {"quantization_config": qconfig, "torch_dtype": "float16"}
    (out / "config.json").write_text(json.dumps(config))


def decode_tok_s(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s with `batch` requests in flight, prefill excluded."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        vocab = engine.config.hf_config.get("vocab_size", SHAPE["vocab_size"])
        prompt = [3 + (i * 7919 + j * 31) % (vocab - 3) for j in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    started, produced = None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if started is None:
            started = time.perf_counter()  # after the step that ran every prefill
            continue
        produced += len(outputs)
    return produced / (time.perf_counter() - started)


def load_engine(folder: Path, dtype: str, max_batch: int) -> LLMEngine:
    engine = LLMEngine(
        folder,
        dtype=dtype,
        device="cpu",
        max_model_len=1024,
        num_kv_blocks=max_batch * 8 + 8,
        max_num_seqs=max_batch,
    )
    decode_tok_s(engine, 1, 16, 4)  # warm-up: kernel choice, first allocations
    return engine


def measure(engines: dict[str, LLMEngine], batches: list[int], tokens: int, repeats: int):
    """Best of `repeats` per variant and batch, the variants taking turns in each round so
    that a busy spell on a shared machine hits all of them alike."""
    results = {
        name: {"weight_bytes": weight_bytes(e.runner.model), "step_bytes": step_bytes(e)}
        for name, e in engines.items()
    }
    lib = kernels.get()
    default = lib.bf16_mode() if lib is not None else 0
    for _ in range(repeats):
        for batch in batches:
            for name, engine in engines.items():
                if lib is not None:  # one library, one bf16 inner loop at a time
                    lib.bf16_mode(0 if name == "bf16-widen" else default)
                key = f"decode_b{batch}_tok_s"
                speed = decode_tok_s(engine, batch, 16, tokens)
                results[name][key] = max(results[name].get(key, 0.0), speed)
    return results


def step_bytes(engine: LLMEngine) -> int:
    """What a batch-1 decode step reads: the bytes of every weight tensor (not their
    storages, which a packed weight pads to whole 2 MiB pages) but the embedding table
    (one row of it), unless the LM head is that table."""
    model = engine.runner.model
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    skip = set() if embed is None or tied else {id(m) for m in embed.modules()}
    seen: dict[int, int] = {}
    for module in model.modules():
        if id(module) in skip:
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def read_gb_s(nbytes: int) -> float:
    """A plain read of nbytes (fp32, torch's sum), best of 5."""
    data = torch.ones(nbytes // 4)
    best = min(timed(data.sum) for _ in range(5))
    return nbytes / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def against_fp32(results: dict, batches: list[int]) -> dict:
    """Each variant's memory and decode speed as multiples of fp32's, and its batch-1
    weight-read rate against a plain read of the same bytes; returns fp32's row."""
    base = results["fp32"]
    for r in results.values():
        r["memory_x"] = r["weight_bytes"] / base["weight_bytes"]
        for b in batches:
            r[f"b{b}_x"] = r[f"decode_b{b}_tok_s"] / base[f"decode_b{b}_tok_s"]
        r["b1_GB_s"] = r["step_bytes"] * r["decode_b1_tok_s"] / 1e9
        r["read_GB_s"] = read_gb_s(r["step_bytes"])
        r["b1_x_read"] = r["b1_GB_s"] / r["read_GB_s"]
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--model", type=Path, help="an HF Llama folder instead of the 58M")
    parser.add_argument("--size", choices=["58m", "246m"], default="58m", help="bench model")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="fp32 and any of these")
    parser.add_argument("--scales", action="store_true", help="only bf16 vs fp32 int4 scales")
    args = parser.parse_args()
    if args.scales:
        cost = scale_cost(args.threads)
        for key, ms in cost.items():
            print(f"{key:<22}{ms:>8.3f} ms")
        print(json.dumps({"bench": "quant-scales", "cpu": cpu_info(), "results": cost}))
        return
    torch.set_num_threads(args.threads)
    tokens, repeats = (16, 1) if args.quick else (args.tokens, args.repeats)
    variants = ["fp32"] + [v for v in args.variants.split(",") if v in VARIANTS and v != "fp32"]
    batches = [1, 16]
    with tempfile.TemporaryDirectory() as tmp:
        print("building the bench model's int8/int4 copies ...", file=sys.stderr)
        model = args.model
        if model is None and args.size == "246m":
            model = Path(tmp) / "246m"
            build_246m(model)
        folders = make_variants(Path(tmp), model, variants)
        engines = {name: load_engine(*folders[name], max(batches)) for name in variants}
        print("measuring (the variants take turns) ...", file=sys.stderr)
        results = measure(engines, batches, tokens, repeats)
    base = against_fp32(results, batches)
    print_table(results, batches)
    goals = {"fp32_b1_ge_0.9_read": base["b1_x_read"] >= 0.9}
    if "int8" in results:
        goals["int8_memory_le_0.27x"] = results["int8"]["memory_x"] <= 0.27
        goals["int8_b1_ge_2x"] = results["int8"]["b1_x"] >= 2.0
    if "int4" in results:
        goals["int4_b1_ge_3x"] = results["int4"]["b1_x"] >= 3.0
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    load = os.getloadavg()[0]
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, avx512_bf16: {'yes' if cpu['avx512_bf16'] else 'no'}")
    print(json.dumps({"bench": "quant", "threads": args.threads, "tokens": tokens, "cpu": cpu,
                      "load_avg_1m": load, "results": results, "goals": goals}))  # fmt: skip


def scale_cost(threads: int, layers: int = 16) -> dict[str, float]:
    """ms per pass over a 246M model's int4 matmuls (group 128; 16 layers, so the codes
    come from memory, not from cache), with bf16 scales and zeros (bitserve's int4)
    against fp32 (AWQ/GPTQ's, exact): the same codes, at 1 and 16 rows, best of 7."""
    from torch import nn

    from bitserve.llm.quant.linear import Int4CheckpointLinear, Int4Linear

    torch.set_num_threads(threads)
    shapes = [(1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024)] * layers  # (in, out)
    stacks: dict[str, list] = {"bf16": [], "fp32": []}
    for k, n in shapes:
        own = Int4Linear.from_float(nn.Linear(k, n, bias=False), 128)
        exact = Int4CheckpointLinear(k, n, False, 128)
        exact.fill(own.unpacked()[:, :k], torch.full((n, k // 128), 8), own.scales.float())
        for kind, layer in (("bf16", own), ("fp32", exact)):
            layer.prepare()
            stacks[kind].append(layer)
    out: dict[str, float] = {}
    for rows in (1, 16):
        xs = {k: torch.randn(rows, k) for k in (1024, 2816)}
        for _ in range(7):  # the two take turns: a busy spell hits both
            for kind, stack in stacks.items():

                def step(stack=stack, xs=xs):
                    for layer in stack:
                        layer.matmul(xs[layer.in_features])

                key = f"{kind}_scales_m{rows}_ms"
                out[key] = min(out.get(key, 1e9), timed(step) * 1e3)
    return out


def cpu_info() -> dict:
    """The CPU's model name and whether it has avx512_bf16 (bf16's vdpbf16ps loop)."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            if key.strip() == "flags":
                flags = set(value.split())
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags}


def print_table(results: dict[str, dict], batches: list[int]) -> None:
    header = f"{'variant':<11}{'weights MiB':>12}{'x fp32':>8}"
    for b in batches:
        header += f"{f'b{b} tok/s':>12}{'x fp32':>8}"
    print(header + f"{'b1 GB/s':>9}{'x read':>8}")
    for name, r in results.items():
        line = f"{name:<11}{r['weight_bytes'] / 2**20:>12.1f}{r['memory_x']:>8.3f}"
        for b in batches:
            line += f"{r[f'decode_b{b}_tok_s']:>12.1f}{r[f'b{b}_x']:>8.2f}"
        print(line + f"{r['b1_GB_s']:>9.1f}{r['b1_x_read']:>8.2f}")


if __name__ == "__main__":
    main()
