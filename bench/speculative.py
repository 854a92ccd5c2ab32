"""Speculative decoding: tok/s with and without, acceptance, and the verification's cost.

    .venv/bin/python -m bench.speculative [--rounds 3] [--tokens 64] [--no-1b]

Same weights and prompts for every variant, greedy (so each speculative variant's tokens
are checked equal to the plain engine's), prefix caching off (a later round would hit
an earlier one's prompts), the engine's offline API (`LLMEngine`, what serve runs).
One engine per part: each variant is a speculator set on it (none for "plain"), so every
variant reads the same weights and KV pool at the same addresses. In every round each
prompt (batch 1; a part's whole batch when its prompts run together) goes through all
variants one after another, the order rotated from prompt to prompt and round to round
(a burst of load on the shared box lands on all of them), and the ratios are taken
within the round; the table shows the median ratio over the rounds and its spread
(min-max), by wall-clock time ("x plain") and by the engine thread's CPU time ("x cpu":
what other processes on a shared box took of the core is left out; cache and
memory-bandwidth contention is not). The machine is shared and noisy: read the spreads.
Batch-1 rates include each request's prefill (~14% of a plain request on tinylm, the
same with speculation), so a part's ratio is below the decode steps' own.

1. demo pair, batch 1: models/tinylm and its draft models/tinylm/draft (tools/train_lm.py
   --draft-of, the same corpus; "draft" its int8 version 2, "draft-fp32" version 1), on
   held-out verses (models/tinylm/heldout.txt, never trained on): the first words of a
   verse as the prompt, `--tokens` new tokens. The drafts with the settings the tune
   part chose (`--draft-k` 5, `--draft-vocab` 512: the LM head scores the 512 most
   frequent tokens, `--confidence` 0.3: a stop after a token the draft gave under 0.3),
   "draft-k4-full" as before (k = `--k`, every step, the whole head); n-gram its
   defaults (k = 6, 1..5-token matches).
2. copy-heavy, batch 1: prompts whose plain answer repeats spans of them
   (`copy_heavy_prompts`: a held-out passage of three verses and the start of its first
   verse again, kept when at least half of the plain greedy answer's tokens lie in
   3-token spans of the prompt; the first `--prompts` such, chosen on the plain answers
   alone); n-gram with its defaults, without one-token matches (ngram_min 2) and with
   k = `--k`; the draft. Each part's "coverage" is that share on its plain answers.
3. streams: the copy-heavy prompts 1, 2, 4, 8, 16 at once (`--streams`) with n-gram
   speculation forced on (max_batch 64): where it stops paying (speculative.MAX_BATCH
   comes from here); and 16 at once with the default configuration (speculation off
   above MAX_BATCH: what that costs, ~1.0 if nothing).
4. overhead bound: a ~1B random-weight Llama (TinyLlama's shape, fp32), batch 1; the
   draft is the target itself, so all k = 4 proposals are accepted and every step scores
   5 tokens. Per step: a plain decode against the verification step (the target's
   forward over 5 rows, verification, rollback), the proposer's time taken out.

5. tune: the draft's settings (k, draft_vocab, confidence) on 16 other held-out verses
   (from the 200th), the same way as part 1 (`--tune-grid` picks some).
6. breakdown: where a batch-1 step's CPU time goes (ms per engine step: the proposer,
   its draft layers and LM head, the scheduler, the target's layers and head, the
   verification or sampler, the rest), plain and speculative, on parts 1 and 2's prompts.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bitserve.llm.engine import LLM
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.speculative import SpecStats, SpeculativeConfig, Speculator

ROOT = Path(__file__).resolve().parents[1]
TINYLM = ROOT / "models" / "tinylm"
TARGET = TINYLM / "1"
ENGINE = dict(kv_cache_memory=64 << 20, enable_prefix_caching=False, max_model_len=256)


def heldout() -> list[str]:
    lines = (TINYLM / "heldout.txt").read_text().splitlines()
    return [line for line in lines if len(line.split()) >= 12]


def demo_prompts(n: int, start: int = 0) -> list[str]:
    return [" ".join(line.split()[:6]) for line in heldout()[start : start + n]]


# the demo draft's settings: chosen by the tune part (on other verses than the demo's)
DRAFT_K, DRAFT_VOCAB, CONFIDENCE = 5, 512, 0.3
TUNE_FROM = 200  # the tune part's verses: held out, and not the demo part's (its first)


def copy_prompts(n: int) -> list[str]:
    verses = heldout()
    passages = [verses[i : i + 3] for i in range(0, 3 * n, 3)]
    return ["\n".join(p) + "\n" + " ".join(p[0].split()[:4]) for p in passages]


COPY_SPAN, COPY_COVERAGE = 3, 0.5  # the copy-heavy rule (`copy_heavy_prompts`)


def coverage(prompt: list[int], answer: list[int], n: int = COPY_SPAN) -> float:
    """The share of the answer's tokens inside a span of n or more of its tokens that
    occurs in the prompt: what a prompt lookup could have proposed."""
    spans = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    hit = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if tuple(answer[i : i + n]) in spans:
            hit[i : i + n] = [True] * n
    return sum(hit) / max(len(answer), 1)


def copy_heavy_prompts(n: int, tokens: int) -> list[str]:
    """Issue 31's copy-heavy workload, "a prompt whose answer repeats spans of it": the
    passages of `copy_prompts` in order, kept when the plain engine's greedy answer
    (`tokens` new tokens) has at least COPY_COVERAGE of its tokens in spans of COPY_SPAN
    that occur in the prompt; the first n such. Decided on the plain answers only
    (tinylm mostly does not copy: over all 197 passages the median is 0.11), before
    any speculative run; the table gives each part's coverage."""
    llm = LLM(TARGET, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    candidates, kept = copy_prompts(len(heldout()) // 3), []
    for i in range(0, len(candidates), 16):
        group = candidates[i : i + 16]
        for prompt, out in zip(group, llm.generate(group, params), strict=True):
            if coverage(out.prompt_token_ids, out.outputs[0].token_ids) >= COPY_COVERAGE:
                kept.append(prompt)
        if len(kept) >= n:
            break
    llm.shutdown()
    return kept[:n]


def run(llm: LLM, prompts: list[str], tokens: int, together: bool) -> tuple[float, float, list]:
    """(seconds, CPU seconds of this thread, token ids): all prompts at once, or one by
    one. The CPU time leaves out the time other processes held the core (the engine's
    step loop is this one thread at --threads 1)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.thread_time()
    if together:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate(p, params)[0] for p in prompts]
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    run.prompt_ids = [o.prompt_token_ids for o in outs]  # (coverage)
    return seconds, cpu, [o.outputs[0].token_ids for o in outs]


def acceptance(stats: SpecStats) -> dict:
    pairs = zip(stats.accepted_at, stats.proposed_at, strict=True)
    return {
        "acceptance": stats.accepted / max(stats.proposed, 1),
        "by_position": [round(a / max(p, 1), 3) for a, p in pairs],
        "tokens_per_step": stats.emitted / max(stats.steps, 1),
    }


def compare(variants: dict, prompts, tokens, together, rounds, target: Path = TARGET) -> dict:
    """Each variant's tok/s per round (interleaved), ratios to "plain" within rounds.

    One engine for every variant: a variant is the speculator set on it (None: plain),
    swapped between runs, so all of them read the same weights and KV pool at the same
    addresses (an engine per variant measured the one loaded first 1.1-1.2x faster in
    its plain steps on this box: where its pages landed, not what it computed)."""
    llm = LLM(target, **ENGINE)
    engine = llm.engine
    specs = {
        name: None
        if spec is None
        else Speculator(
            SpeculativeConfig.parse(spec, engine.config.model),
            engine.config,
            engine.runner.num_blocks,
        )
        for name, spec in variants.items()
    }

    def go(name: str, n_prompts: list[str], n_tokens: int):
        engine.speculator = specs[name]
        try:
            return run(llm, n_prompts, n_tokens, together)
        finally:
            engine.speculator = None

    for name, spec in specs.items():  # warm-up, neither timed nor counted
        go(name, prompts[:2], 8)
        if spec is not None:
            spec.stats = SpecStats()
    speeds: dict[str, list[float]] = {name: [] for name in specs}
    cpus: dict[str, list[float]] = {name: [] for name in specs}
    names = list(specs)
    # batch 1: the variants take turns prompt by prompt (a load burst on the shared box
    # lands on all of them), each round's sums giving its rates; together: batch by batch
    groups = [prompts] if together else [[p] for p in prompts]
    reference, prompt_ids = [], []
    for group in groups:
        reference += go("plain", group, tokens)[2]
        prompt_ids += run.prompt_ids
    covered = statistics.mean(map(coverage, prompt_ids, reference))
    for r in range(rounds):
        seconds = {name: 0.0 for name in names}
        cpu = {name: 0.0 for name in names}
        ids: dict[str, list] = {name: [] for name in names}
        for g, group in enumerate(groups):
            turn = (r + g) % len(names)
            for name in names[turn:] + names[:turn]:  # order rotated
                wall, thread, got = go(name, group, tokens)
                seconds[name] += wall
                cpu[name] += thread
                ids[name] += got
        n = sum(map(len, reference))
        for name in names:
            if ids[name] != reference:
                raise AssertionError(f"{name}: greedy tokens differ from the plain engine's")
            speeds[name].append(n / seconds[name])
            cpus[name].append(n / cpu[name])
    out = {}
    for name, spec in specs.items():
        ratios = [s / p for s, p in zip(speeds[name], speeds["plain"], strict=True)]
        row = {"tok_s": statistics.median(speeds[name]), "ratio": statistics.median(ratios)}
        row["spread"] = [min(ratios), max(ratios)]
        cpu = [s / p for s, p in zip(cpus[name], cpus["plain"], strict=True)]
        row |= {"cpu_ratio": statistics.median(cpu), "cpu_spread": [min(cpu), max(cpu)]}
        if spec is not None:
            row |= acceptance(spec.stats)
        out[name] = row
    out["plain"]["coverage"] = covered
    llm.shutdown()
    return out


class Timers:
    """CPU time (this thread) per labelled part of a step: `wrap(obj, name, label)` makes
    obj.name count its calls' time under `label` (an inner part's time is also its
    caller's: the table subtracts)."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, obj, name: str, label: str, result=None) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                out = inner(*args, **kwargs)
            finally:
                self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - t0
            return out if result is None else result(out)

        self.undo.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, timed)

    def restore(self) -> None:
        for obj, name, own in reversed(self.undo):
            if own is not None:  # an attribute of the instance itself: put back
                setattr(obj, name, own)
            elif name in vars(obj):
                delattr(obj, name)
        self.undo.clear()


def breakdown(spec: dict | None, prompts: list[str], tokens: int, rounds: int) -> dict:
    """Where a batch-1 step's CPU time goes (ms per engine step, median over rounds):
    the whole step; the proposer (a draft's layers, its LM head, the rest of it: plan,
    sync, Python); the scheduler; the target's forward (its layers, its LM head); the
    verification (or the sampler); the rest (appending tokens, stops, rollback)."""
    llm = LLM(TARGET, **ENGINE)
    engine = llm.engine
    if spec is not None:
        config = SpeculativeConfig.parse(spec, engine.config.model)
        engine.speculator = Speculator(config, engine.config, engine.runner.num_blocks)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    per_round = []
    for _ in range(rounds):
        timers = Timers()
        t = timers.wrap
        runner, model = engine.runner, engine.runner.model
        t(engine, "step", "step")
        t(engine.scheduler, "schedule", "schedule")
        t(runner, "execute", "target forward")
        t(model, "compute_logits", "target head")
        t(engine, "sample", "sample")
        steps = [0]
        if engine.speculator is not None:
            t(engine.speculator, "propose", "propose")
            t(engine.speculator, "verify", "verify")
            proposer = engine.speculator.proposer
            if hasattr(proposer, "runner"):
                d_runner, d_model = proposer.runner, proposer.runner.model
                t(d_model, "compute_logits", "draft head")
                if getattr(d_model, "draft_head", None) is not None:  # greedy loop's
                    t(d_model.draft_head, "logits", "draft head")
                t(d_runner, "execute", "draft forward (generic)")

                def wrap_stepper(step, timers=timers):
                    if step is None:
                        return None
                    holder = type("H", (), {"step": staticmethod(step)})
                    timers.wrap(holder, "step", "draft layers")
                    return holder.step

                t(d_model, "fused_stepper", "draft stepper setup", wrap_stepper)
        inner_step = engine.step

        def counted(*a, inner=inner_step, steps=steps, **k):
            steps[0] += 1
            return inner(*a, **k)

        engine.step = counted
        for p in prompts:
            llm.generate(p, params)
        engine.step = inner_step
        timers.restore()
        c = {k: 1e3 * v / steps[0] for k, v in timers.cpu.items()}
        c["steps"] = steps[0]
        per_round.append(c)
    llm.shutdown()
    keys = sorted({k for c in per_round for k in c})
    med = {k: statistics.median(c.get(k, 0.0) for c in per_round) for k in keys}
    spread = {
        k: [min(c.get(k, 0.0) for c in per_round), max(c.get(k, 0.0) for c in per_round)]
        for k in keys
    }
    return {"ms_per_step": med, "spread": spread, "tokens": tokens * len(prompts)}


def breakdown_table(name: str, b: dict) -> str:
    m = b["ms_per_step"]
    g = m.get
    parts = [
        ("step (all)", g("step", 0)),
        ("  propose", g("propose", 0)),
        ("    draft layers", g("draft layers", 0)),
        ("    draft head", g("draft head", 0)),
        ("    draft generic forward (prompt catch-up)", g("draft forward (generic)", 0)),
        (
            "    propose: the rest (Python, plan, syncs)",
            g("propose", 0)
            - g("draft layers", 0)
            - g("draft head", 0)
            - g("draft forward (generic)", 0),
        ),
        ("  schedule", g("schedule", 0)),
        ("  target forward: layers", g("target forward", 0) - g("target head", 0)),
        ("  target forward: head", g("target head", 0)),
        ("  verify (accept) / sample", g("verify", 0) + g("sample", 0)),
        (
            "  the rest (append, stops, rollback, Python)",
            g("step", 0)
            - g("propose", 0)
            - g("schedule", 0)
            - g("target forward", 0)
            - g("verify", 0)
            - g("sample", 0),
        ),
    ]
    tok_per_step = b["tokens"] / max(g("steps", 1), 1)
    lines = [
        f"{name}: {g('steps', 0):.0f} steps, {tok_per_step:.2f} tokens/step, "
        f"{g('step', 0) / tok_per_step:.3f} ms CPU per token"
    ]
    lines += [f"  {label:<46} {v:7.3f} ms" for label, v in parts]
    return "\n".join(lines)


def overhead_1b(folder: Path | None, steps: int) -> dict:
    """ms per plain decode step and per verification step (k = 4, all accepted)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = None
    if folder is None:
        tmp = tempfile.TemporaryDirectory()
        folder = Path(tmp.name) / "1b"
        config = LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
            max_position_embeddings=512, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.no_grad():
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    kw = dict(kv_cache_memory=256 << 20, max_model_len=512, enable_prefix_caching=False)
    spec = {"method": "draft", "model": str(folder), "num_tokens": 4}
    prompt = list(range(100, 132))
    result = {}
    for name, extra in (("plain", {}), ("verify_k4", {"speculative": spec})):
        llm = LLM(folder, **kw, **extra)
        engine, times, cpus, propose = llm.engine, [], [], [0.0, 0.0]
        if engine.speculator is not None:  # the proposer's time is not the step's
            inner = engine.speculator.propose

            def timed(running, inner=inner, propose=propose):
                t0, c0 = time.perf_counter(), time.thread_time()
                inner(running)
                propose[0] += time.perf_counter() - t0
                propose[1] += time.thread_time() - c0

            engine.speculator.propose = timed
        params = SamplingParams(temperature=0, max_tokens=5 * steps + 1, ignore_eos=True)
        engine.add_request("r", prompt, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests() and len(times) < steps:
            propose[:] = [0.0, 0.0]
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            times.append(time.perf_counter() - t0 - propose[0])
            cpus.append(time.thread_time() - c0 - propose[1])
        engine.abort_request("r")
        result[name] = 1e3 * statistics.median(times)
        result[f"{name}_cpu"] = 1e3 * statistics.median(cpus)
        llm.shutdown()
        del llm, engine
    result["ratio"] = result["verify_k4"] / result["plain"]
    result["cpu_ratio"] = result["verify_k4_cpu"] / result["plain_cpu"]
    if tmp is not None:
        tmp.cleanup()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="the drafts' k (and ngram-k's)")
    parser.add_argument("--draft-k", type=int, default=DRAFT_K, help="the demo draft's k")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    parser.add_argument("--confidence", type=float, default=CONFIDENCE)
    parser.add_argument("--tune-grid", default="", help="the tune part's V-c-k settings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="demo,copy,streams,default,1b")
    parser.add_argument("--streams", default="1,2,4,8,16", help="part 3's stream counts")
    parser.add_argument("--no-1b", action="store_true")
    parser.add_argument("--model-1b", type=Path, help="a ~1B HF folder (default: built)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    k, r, t = args.k, args.rounds, args.tokens
    # the draft as before this round: k proposals every step, the full LM head
    draft_old = {"method": "draft", "model": "draft", "num_tokens": k, "confidence": 0.0}
    # the demo draft's settings (the tune part measured them): its head restricted to the
    # draft_vocab most frequent tokens, a stop after a token it gave under `confidence`
    tuned = {"draft_vocab": args.draft_vocab, "confidence": args.confidence}
    draft = {"method": "draft", "model": "draft", "num_tokens": args.draft_k, **tuned}
    fp32 = {**draft, "model": "draft/1"}
    ngram = {"method": "ngram"}  # the defaults: k = 6, 1..5-token matches
    # no one-token matches (the default before): fewer speculative steps, right more often
    ngram2 = {"method": "ngram", "ngram_min": 2}
    ngram_k = {"method": "ngram", "num_tokens": k}
    forced = {"method": "ngram", "max_batch": 64}
    results: dict = {"cpu": cpu(), "threads": args.threads, "k": k, "tokens": t, "rounds": r}
    parts = set(args.parts.split(",")) - ({"1b"} if args.no_1b else set())
    if "demo" in parts:
        results["demo_b1"] = compare(
            {"plain": None, "draft": draft, "draft-fp32": fp32, f"draft-k{k}-full": draft_old,
             "ngram": ngram},
            demo_prompts(args.prompts), t, False, r,
        )  # fmt: skip
    copy = copy_prompts(16)  # the streams' prompts (whether the answer copies or not)
    if parts & {"copy", "breakdown"}:
        heavy = copy_heavy_prompts(args.prompts, t)
    if "copy" in parts:
        results["copy_b1"] = compare(
            {"plain": None, "ngram": ngram, "ngram-2..5": ngram2, f"ngram-k{k}": ngram_k,
             "draft": draft},
            heavy, t, False, r,
        )  # fmt: skip
    for n in map(int, args.streams.split(",")) if "streams" in parts else []:
        results[f"copy_x{n}_forced"] = compare(
            {"plain": None, "ngram": forced}, copy[:n], t, True, r
        )
    if "default" in parts:
        results["copy_x16_default"] = compare(
            {"plain": None, "ngram": ngram, "draft": draft}, copy, t, True, r
        )
    if "tune" in parts:  # the draft's settings, on other held-out verses than "demo"'s
        grid = {"plain": None, f"draft-k{k}-full": draft_old}
        for v, c, kk in ((1024, 0, 4), (512, 0, 4), (1024, 0.3, 5), (512, 0.3, 5),
                         (1024, 0.3, 6), (1024, 0.2, 5), (1024, 0.4, 5), (256, 0.3, 5),
                         (512, 0.3, 4), (512, 0.3, 6), (512, 0.25, 5), (512, 0.35, 5)):  # fmt: skip
            if args.tune_grid and f"{v}-{c}-{kk}" not in args.tune_grid.split(","):
                continue
            name = f"V{v}-c{c}-k{kk}"
            grid[name] = {**draft, "num_tokens": kk, "draft_vocab": v, "confidence": c}
        results["tune"] = compare(grid, demo_prompts(2 * args.prompts, TUNE_FROM), t, False, r)
    if "breakdown" in parts:
        b = results["breakdown"] = {}
        for name, spec, prompts in (
            ("plain, held-out verses", None, demo_prompts(args.prompts)),
            ("draft (int8, as part 1), held-out verses", draft, demo_prompts(args.prompts)),
            ("plain, copy-heavy", None, heavy),
            ("n-gram, copy-heavy", ngram, heavy),
        ):
            b[name] = breakdown(spec, prompts, t, r)
            print(breakdown_table(name, b[name]), flush=True)
    if "1b" in parts:
        results["overhead_1b"] = overhead_1b(args.model_1b, steps=8)
    print(table(results))
    print(json.dumps(results))


def table(results: dict) -> str:
    lines = [
        f"{'part':<18} {'variant':<14} {'tok/s':>7} {'x plain':>8} {'spread':>11} "
        f"{'x cpu':>6} {'spread':>11} {'accept':>7} {'by position':<28} {'tok/step':>8}"
    ]
    for part, rows in results.items():
        if not isinstance(rows, dict) or "plain" not in rows or part == "overhead_1b":
            continue
        for name, row in rows.items():
            spread = f"{row['spread'][0]:.2f}-{row['spread'][1]:.2f}"
            spread += f" {row['cpu_ratio']:>6.2f} "
            spread += f"{row['cpu_spread'][0]:.2f}-{row['cpu_spread'][1]:.2f}".rjust(11)
            extra = f" coverage {row['coverage']:.0%}" if "coverage" in row else ""
            if "acceptance" in row:
                by = "/".join(f"{a:.2f}" for a in row["by_position"])
                extra = f" {row['acceptance']:>7.0%} {by:<28} {row['tokens_per_step']:>8.2f}"
            lines.append(
                f"{part:<18} {name:<14} {row['tok_s']:>7.1f} {row['ratio']:>8.2f} {spread:>11}"
                + extra
            )
    if "overhead_1b" in results:
        o = results["overhead_1b"]
        lines.append(
            f"1B batch 1: plain decode step {o['plain']:.1f} ms, verification step (k=4) "
            f"{o['verify_k4']:.1f} ms: {o['ratio']:.2f}x (CPU time {o['plain_cpu']:.1f} and "
            f"{o['verify_k4_cpu']:.1f} ms: {o['cpu_ratio']:.2f}x)"
        )
    return "\n".join(lines)


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    main()
