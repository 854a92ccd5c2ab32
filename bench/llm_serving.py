"""LLM serving: bitserve against llama.cpp's server, same weights, same load, one run.

    .venv-bench/bin/python bench/llm_serving.py --tokenizer DIR \
        [--convert PATH/convert_hf_to_gguf.py] [--requests 64] [--threads 1]

NEEDS bitserve's OpenAI API (/v1/completions, streamed); until that lands the bitserve
row fails and is reported as such. The random-weight Llama-shaped model of
bench/llm_throughput.py (hidden 512, 8 layers, vocab 32000) is built into a temp dir
with the tokenizer from --tokenizer (a 32000-token Llama tokenizer), converted to an
fp32 GGUF by llama.cpp's convert_hf_to_gguf.py (shipped in llama-cpp-python's source
distribution), and served by:
  - bitserve: `bitserve serve` on a repository holding the model (backend "llm");
  - llama.cpp: llama-cpp-python's server (`python -m llama_cpp.server`), or any
    command given with --llama-server (e.g. a built `llama-server -np 16 -cb`).
Both are driven by `bitserve bench` (bitserve/bench): 16 concurrent streams, 100-token
prompts, 64 output tokens with ignore_eos. Goal: bitserve's output tok/s >= llama.cpp's
at fp32, with a lower TTFT p99. Prints both tables, the comparison, the goal lines and
one JSON line; reports go to bench/results/llm_serving/{bitserve,llamacpp}/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "llm_serving"
sys.path.insert(0, str(ROOT / "bench"))

LLM_CONFIG = """\
backend = "llm"
max_batch_size = 0

[parameters]
max_num_seqs = 64
max_model_len = 1024
"""


def build(folder: Path, tokenizer: Path, convert: Path) -> Path:
    """HF folder (weights + tokenizer) in folder/hf, its fp32 GGUF at folder/model.gguf."""
    from llm_throughput import build_model

    hf = folder / "hf"
    build_model(hf)
    for f in tokenizer.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name == "special_tokens_map.json"):
            shutil.copy(f, hf / f.name)
    gguf = folder / "model.gguf"
    cmd = [sys.executable, str(convert), str(hf), "--outtype", "f32", "--outfile", str(gguf)]
    subprocess.run(cmd, check=True)
    return gguf


def start(cmd: list[str], ready_url: str, log: Path, timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{ready_url} not ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def bench(url: str, model: str, out: Path, cfg) -> dict:
    """`bitserve bench` with the issue's load; returns its result.json."""
    args = [
        *("-m", "bitserve.cli", "bench", url, "--model", model, "--api", "completions"),
        *("--concurrency", str(cfg.concurrency), "--num-requests", str(cfg.requests)),
        *("--input-len", "100", "--output-len", "64", "--length-dist", "fixed"),
        *("--ignore-eos", "--warmup", str(cfg.concurrency), "--goodput", "ttft:500"),
        *("--goodput", "tpot:50", "--report-dir", str(out), "--timeout", "600"),
    ]
    subprocess.run([sys.executable, *args], check=True)
    return json.loads((out / "result.json").read_text())["points"][0]


def serve_and_bench(name: str, cmd: list[str], ready: str, url: str, model: str, cfg) -> dict:
    log = RESULTS / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = start(cmd, ready, log)
    except RuntimeError as e:
        return {"error": str(e)}
    try:
        return bench(url, model, RESULTS / name, cfg)
    except subprocess.CalledProcessError as e:
        return {"error": f"bench failed: {e}"}
    finally:
        stop(proc)


def goals(b: dict, ll: dict) -> list[str]:
    def line(name: str, a, c, ok) -> str:
        status = "n/a" if a is None or c is None else ("pass" if ok(a, c) else "fail")
        return f"[{status:>4}] {name}: bitserve {a} vs llama.cpp {c}"

    out_b, out_l = b.get("output_throughput"), ll.get("output_throughput")
    t_b, t_l = (p.get("ttft", {}).get("p99_ms") for p in (b, ll))
    return [
        line("output tok/s >= llama.cpp (fp32)", out_b, out_l, lambda x, y: x >= y),
        line("TTFT p99 ms < llama.cpp", t_b, t_l, lambda x, y: x < y),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="32000-token HF tokenizer dir")
    p.add_argument("--convert", type=Path, required=True, help="llama.cpp convert_hf_to_gguf.py")
    p.add_argument("--llama-server", default=f"{sys.executable} -m llama_cpp.server")
    p.add_argument("--bitserve", default=str(ROOT / ".venv" / "bin" / "bitserve"))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=18700)
    cfg = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llm-serving-") as tmp:
        folder = Path(tmp)
        gguf = build(folder, cfg.tokenizer, cfg.convert)
        repo = folder / "repo" / "llama"
        (repo / "1").mkdir(parents=True)
        (repo / "config.toml").write_text(LLM_CONFIG)
        for f in (folder / "hf").iterdir():
            (repo / "1" / f.name).symlink_to(f)
        bs_port, ll_port = cfg.port, cfg.port + 1
        bs_cmd = [cfg.bitserve, "serve", "--repository", str(repo.parent), "--port", str(bs_port)]
        bs_cmd += ["--threads", str(cfg.threads)]
        ll_cmd = [*cfg.llama_server.split(), "--model", str(gguf), "--port", str(ll_port)]
        ll_cmd += ["--n_threads", str(cfg.threads), "--n_ctx", "4096", "--model_alias", "llama"]
        b = serve_and_bench(
            "bitserve", bs_cmd, f"http://127.0.0.1:{bs_port}/v2/health/ready",
            f"http://127.0.0.1:{bs_port}", "llama", cfg,
        )  # fmt: skip
        ll = serve_and_bench(
            "llamacpp", ll_cmd, f"http://127.0.0.1:{ll_port}/v1/models",
            f"http://127.0.0.1:{ll_port}", "llama", cfg,
        )  # fmt: skip
    if "error" not in b and "error" not in ll:
        a, c = RESULTS / "llamacpp" / "result.json", RESULTS / "bitserve" / "result.json"
        subprocess.run([sys.executable, "-m", "bitserve.cli", "bench", "compare", str(a), str(c)])
    for line in goals(b, ll):
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
