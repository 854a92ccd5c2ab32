"""GGUF files as llama.cpp users have them, decoded by bitserve in their own formats.

    .venv/bin/python -m bench.gguf [--size 246m] [--threads 1] [--tokens 64] [--repeats 3]
        [--variants fp32,int8,int4,Q8_0,Q4_K_M]

One random-weight Llama of bench/llm_serving.py's shape (246m: hidden 1024, 16 layers,
GQA 16/4, intermediate 2816 = 11 x 256, so every K-quant row is whole super-blocks;
vocab 32000, untied head) is built in a temp dir and made into: bitserve's own int8 and
int4 (`bitserve quantize`'s functions, as bench/quant.py), and GGUF files by llama.cpp's
converter (F32) and `llama-quantize` (Q8_0, Q4_K_M), which bitserve serves through
`GgmlLinear` (kernels/csrc/ggml.c): by default with int8 activations (its tiles, every
batch size, batch 1 included), and as "Q8_0 x fp32" / "Q4_K_M x fp32" on the fp32
parity path; the weights column counts what each holds (the tiles, not the file's
bytes). Its tokenizer is the tests' small byte-level BPE (the converter pads the vocab
to 32000); prompts are token ids. Each variant decodes
greedily at batch 1 and 16 through the engine, the variants taking turns in each round,
best of `--repeats` (bench/quant.py's `measure`). "x read" is batch-1 decode's bytes
read per second (each weight once a step, one row of the embedding) against a plain
read of as many bytes measured here: the weight-read floor. The CPU model and its
AVX-512 flags are printed with the table and in the JSON line.

Needs the converter and llama-quantize (tools/fetch_gguf_converter.py,
tools/build_llama_quantize.sh).

    .venv/bin/python -m bench.gguf --kernels [--rows 1,4,16,64,256] [--repeats 3]
        [--threads 1]

One linear layer alone, each of the 246m model's shapes (qkv 1536 x 1024, o, gate_up
5632 x 1024, down 1024 x 2816, the 32000 x 1024 head), at 1..256 rows of x: the packed
fp32 GEMM, bf16 weights (csrc/bf16.c, vdpbf16ps), bitserve's own int8 (per-channel,
x rounded per row: csrc/qgemm.c's int8 GEMM at every row count; "int8 _int_mm" the same
sums through torch._int_mm, its path without the kernels; "int8 x fp32" the C GEMV on
fp32 x that took 1-4 rows before) and int4 (group 32), and each
GGUF block type (random codes, finite scales) with int8 activations (the default,
`gguf_activations = "int8"`, the "a8" tiles: csrc/ggml.c's microkernel) and with fp32
ones ("fp32", the parity path).
Milliseconds per call (process CPU time, which a descheduled spell on a loaded box does
not count; --clock wall for wall time), median of --repeats rounds, the variants taking
turns in each round (the order rotated by one a round); the min-max spread beside each,
and the ratio to int4 on the same shape and rows. Each round also times this core's peak (12
independent chains of vpdpbusd, vdpbf16ps and vfmadd231ps, 512-bit: `bs_isa_peak`), so
a second table gives each variant's multiply-adds per second as a fraction of the VNNI
peak measured in the same round (median over rounds; the peaks themselves are printed).
Then each variant's sum over one 16-layer step."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench.quant import (
    against_fp32,
    decode_tok_s,
    load_engine,
    make_variants,
    measure,
    print_table,
)
from tests.llm.conftest import build_tokenizer
from tools.llama_cpp import CONVERTER, QUANTIZE, convert, quantize

SIZES = {  # bench/llm_serving.py's 246m and 1b
    "246m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=5632),
}  # fmt: skip
VARIANTS = ("fp32", "int8", "int4", "Q8_0", "Q4_K_M", "Q8_0 x fp32", "Q4_K_M x fp32")
X_FP32 = " x fp32"  # a GGUF variant's suffix: its blocks meet fp32 activations (parity path)
GGUF_TYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q5_0")


def cpu() -> dict[str, object]:
    """The CPU's model name and AVX-512 flags, recorded with every figure."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = text.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return {"model": model, "avx512": sorted(f for f in flags if f.startswith("avx512"))}


def build_hf(folder: Path, size: str) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SIZES[size], vocab_size=32000, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def make_files(root: Path, size: str, variants: list[str]) -> dict[str, tuple[Path, str]]:
    """variant -> (folder or .gguf, engine dtype)."""
    hf = build_hf(root / "hf", size)
    own = [v for v in variants if v in ("fp32", "bf16", "int8", "int4")]
    folders = make_variants(root, hf, own)
    ggufs = sorted({v.removesuffix(X_FP32) for v in variants} & set(GGUF_TYPES))
    if ggufs:
        f32 = convert(hf, "f32", root / "f32.gguf")
        for kind in ggufs:
            folders[kind] = (quantize(f32, root / f"{kind}.gguf", kind), "float32")
    return {v: folders[v.removesuffix(X_FP32)] for v in variants}


def gguf_engine(name: str, path: Path, dtype: str, max_batch: int):
    """bench.quant's engine, with `gguf_activations` "fp32" for an " x fp32" variant."""
    from bitserve.llm import LLMEngine

    if not name.endswith(X_FP32):
        return load_engine(path, dtype, max_batch)
    engine = LLMEngine(path, dtype=dtype, device="cpu", max_model_len=1024,
                       num_kv_blocks=max_batch * 8 + 8, max_num_seqs=max_batch,
                       gguf_activations="fp32")  # fmt: skip
    decode_tok_s(engine, 1, 16, 4)  # warm-up, as load_engine
    return engine


SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024)}
SHAPES |= {"down": (1024, 2816), "head": (32000, 1024)}  # (out, in); the head once a step
KERNEL_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0")


def random_blocks(kind: str, rows: int, k: int) -> torch.Tensor:
    """rows of `kind` with random codes and fp16 scales of 0.002 (uint8 [rows, bytes])."""
    from bitserve.llm.quant.ggml import BLOCKS

    elems, size = BLOCKS[kind]
    data = torch.randint(0, 256, (rows, k // elems, size), dtype=torch.uint8)
    d = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8)
    for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(kind, (0,)):
        data[:, :, off : off + 2] = d
    return data.view(rows, -1)


def kernels_at(ref: str):
    """The C kernels built from csrc/ as git `ref` has it (a baseline for the a8 tiles:
    their layout and the GgmlPart struct are the same, so one layer's view serves both)."""
    import subprocess

    from bitserve import kernels

    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="bitserve-csrc-"))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    for name in git("ls-tree", "--name-only", f"{ref}:bitserve/kernels/csrc").split():
        (folder / name).write_text(git("show", f"{ref}:bitserve/kernels/csrc/{name}"))
    here = kernels.CSRC
    kernels.CSRC = folder
    try:
        return kernels.Kernels(kernels.build(kernels.compiler()))
    finally:
        kernels.CSRC = here


BASELINE = None  # (ref, Kernels) with --against


def kernel_variants(n: int, k: int) -> dict[str, object]:
    """name -> a callable of x for one layer of out n, in k."""
    from bitserve import kernels
    from bitserve.llm.quant.ggml import GgmlLinear
    from bitserve.llm.quant.linear import Int4Linear, Int8Linear

    lib = kernels.get()
    linear = torch.nn.Linear(k, n, bias=False)
    weight = linear.weight.detach().contiguous()
    packed = lib.pack(weight)
    panels = lib.pack_bf16(weight.bfloat16().contiguous())
    bf16 = kernels.bf16_weight(panels, n, k, None)
    out = {"fp32": lambda x: lib.linear_packed(x, packed, None)}
    out["bf16"] = lambda x, _=panels: lib.gemv(bf16, x)  # (the panels kept alive)
    for name, layer in (
        ("int8", Int8Linear.from_float(linear)),
        ("int4", Int4Linear.from_float(linear, 32)),
    ):
        kernels.attach(layer, lib)
        layer.prepare()
        layer.prepared_for = layer.device
        out[name] = layer.matmul
        if name == "int8":
            out["int8 _int_mm"] = layer.int_mm_matmul
            fields = {"kind": 1, "N": n, "K": k, "data": kernels.ptr(layer.qweight, "void *")}
            view = kernels.ffi().new("Weight *", fields | {"scale": kernels.ptr(layer.scales)})
            out["int8 x fp32"] = lambda x, view=view, _=layer: lib.gemv(view, x)
    for kind in KERNEL_TYPES:
        data = random_blocks(kind, n, k)
        for activations in ("int8", "fp32"):
            layer = GgmlLinear(k, [(kind, data.clone())], activations=activations)
            layer.kernels = lib
            out[kind + (" a8" if activations == "int8" else "")] = layer
            if BASELINE is not None and activations == "int8":  # the same tiles, old kernel
                ref, old = BASELINE
                view = layer.c_weight
                out[f"{kind} a8 @{ref}"] = lambda x, old=old, view=view, _=layer: old.gemv(view, x)
    return out


PEAKS = {"vnni": (0, 768), "bf16": (1, 384), "fma": (2, 192)}  # bs_isa_peak kind, MACs a pass


def isa_peaks(iters: int = 2_000_000, clock=None) -> dict[str, float]:
    """This core's multiply-adds per second for each instruction, 12 chains each (per
    second of `clock`: CPU time by default, which a descheduled spell does not count)."""
    import time

    from bitserve import kernels

    clock = clock or time.thread_time
    lib = kernels.get().lib
    out = {}
    for name, (kind, macs) in PEAKS.items():
        start = clock()
        if lib.bs_isa_peak(kind, iters) < 0:
            continue
        out[name] = iters * macs / (clock() - start)
    return out


def kernel_bench(rows: list[int], repeats: int, clock, only: list[str] | None = None) -> dict:
    """ms a call per layer, rows and variant, by `clock` (each round's peaks too);
    `only`: these variants (and int4, the ratios' base)."""
    results: dict = {"peaks": {name: [] for name in PEAKS}}
    for shape, (n, k) in SHAPES.items():
        variants = kernel_variants(n, k)
        if only:
            variants = {v: f for v, f in variants.items() if v in only or v == "int4"}
        names = list(variants)
        for m in rows:
            x = torch.randn(m, k)
            calls = max(1, int(2e7 / (n * k)))
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(repeats):
                for name, rate in isa_peaks(clock=clock).items():
                    results["peaks"][name].append(rate)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn = variants[name]
                    fn(x)
                    start = clock()
                    for _ in range(calls):
                        fn(x)
                    times[name].append((clock() - start) / calls * 1e3)
            results[f"{shape} {n}x{k} M={m}"] = times
    return results


def print_kernels(results: dict, rows: list[int], threads: int = 1) -> None:
    import statistics

    peaks = results.pop("peaks")
    names = list(next(iter(results.values())))
    print("| layer | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key, times in results.items():
        int4 = statistics.median(times["int4"])
        cells = []
        for name in names:
            med = statistics.median(times[name])
            cells.append(
                f"{med:.3f} ({min(times[name]):.3f}-{max(times[name]):.3f}) {med / int4:.2f}x"
            )
        print(f"| {key} | " + " | ".join(cells) + " |")
    for m in rows:  # one step: 16 layers of each, the head once
        step = {name: 0.0 for name in names}
        for key, times in results.items():
            if key.endswith(f" M={m}"):
                layers = 1 if key.startswith("head") else 16
                for name in names:
                    step[name] += layers * statistics.median(times[name])
        line = ", ".join(f"{name} {v:.1f} ms ({v / step['int4']:.2f}x)" for name, v in step.items())
        print(f"one 246m step at {m} rows: {line}")
    vnni = statistics.median(peaks["vnni"])
    spread = " ".join(
        f"{name} {statistics.median(v) / 1e9:.1f} ({min(v) / 1e9:.1f}-{max(v) / 1e9:.1f})"
        for name, v in peaks.items() if v
    )  # fmt: skip
    print(f"\npeak GMAC/s, median (min-max) over every round: {spread}")
    print(f"multiply-adds a second as a fraction of {threads} x one core's VNNI peak (median):")
    print("| layer | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key, times in results.items():
        n, k = (int(v) for v in key.split()[1].split("x"))
        m = int(key.rsplit("=", 1)[1])
        macs = n * k * m
        cells = [
            f"{macs / (statistics.median(times[name]) * 1e-3) / vnni / threads:.2f}"
            for name in names
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    results["peaks"] = peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="246m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kernels", action="store_true", help="one layer's kernels alone")
    parser.add_argument("--rows", default="1,4,16,64,256", help="--kernels: rows of x")
    parser.add_argument("--against", help="--kernels: also the a8 tiles on csrc/ at this git ref")
    parser.add_argument("--only", help="--kernels: these variants alone (comma-separated; "
                        "int4 always), e.g. 'int8,int8 _int_mm,Q8_0 a8,bf16'")  # fmt: skip
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="--kernels: process CPU time (default: robust to a loaded box, "
                        "counts the pool's threads too) or wall time")  # fmt: skip
    args = parser.parse_args()
    if args.kernels:
        torch.set_num_threads(args.threads)
        from bitserve import kernels

        kernels.get().lib.bs_set_threads(args.threads)
        if args.against:
            global BASELINE
            BASELINE = (args.against, kernels_at(args.against))
            BASELINE[1].lib.bs_set_threads(args.threads)
        rows = [int(m) for m in args.rows.split(",")]
        load = os.getloadavg()[0]
        import time

        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        with torch.inference_mode():  # as the engine runs them (int8's C paths want it)
            only = args.only.split(",") if args.only else None
            results = kernel_bench(rows, args.repeats, clock, only)
        where = cpu()
        print(f"{args.threads} thread(s), {args.clock} time, {where['model']} "
              f"({' '.join(where['avx512'])})")  # fmt: skip
        print(f"load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
        print_kernels(results, rows, args.threads)
        out = {"bench": "gguf-kernels", "clock": args.clock, "threads": args.threads}
        print(json.dumps(out | {"cpu": where, "results": results}))
        return
    if not (CONVERTER.is_file() and QUANTIZE.is_file()):
        raise SystemExit(f"needs {CONVERTER} and {QUANTIZE} (tools/build_llama_quantize.sh)")
    torch.set_num_threads(args.threads)
    variants = ["fp32"] + [v for v in args.variants.split(",") if v != "fp32"]
    batches = [1, 16]
    os.environ.setdefault("BITSERVE_GGUF_CACHE", tempfile.mkdtemp(prefix="bitserve-gguf-"))
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building the {args.size} model and its variants ...", file=sys.stderr)
        files = make_files(Path(tmp), args.size, variants)
        engines = {name: gguf_engine(name, *files[name], max(batches)) for name in variants}
        print("measuring (the variants take turns) ...", file=sys.stderr)
        results = measure(engines, batches, args.tokens, args.repeats)
    against_fp32(results, batches)
    where = cpu()
    print(f"{args.size}, {args.threads} thread(s), {where['model']} ({' '.join(where['avx512'])})")
    print_table(results, batches)
    print(json.dumps({"bench": "gguf", "size": args.size, "threads": args.threads,
                      "tokens": args.tokens, "cpu": where, "load_avg_1m": os.getloadavg()[0],
                      "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
