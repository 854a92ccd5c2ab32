"""Speculative decoding (speculative.py): exact for greedy, exact in distribution for
sampling, and the KV pool and prefix cache whole after any mix of rejections.

References nobody here wrote: transformers' greedy `generate` (test_architectures'
`reference`, fp32, eager attention) for the tokens, transformers' logits for the exact
next-token distributions, scipy's chi-square test for the sampled ones.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from bitserve.llm import SamplingParams, speculative
from bitserve.llm.sampling_params import SamplingError
from bitserve.llm.sequence import Sequence
from bitserve.llm.structured import Guide
from tests.llm.conftest import make_engine
from tests.llm.test_architectures import ARCHS, EXTRA, arch_dirs, reference  # noqa: F401
from tests.llm.test_engine import GREEDY, MIXED, SHARED, generate

# speculation on whatever the batch (the default stops above MAX_BATCH running requests)
# one-token matches too: random test models repeat few longer n-grams
NGRAM = {"method": "ngram", "max_batch": 64, "ngram_min": 1, "ngram_max": 3}


def draft(folder, k: int, **extra) -> dict:
    return {"method": "draft", "model": str(folder), "num_tokens": k, "max_batch": 64, **extra}


@pytest.fixture(scope="module")
def every_dir(model_dirs, arch_dirs):  # noqa: F811
    return {**model_dirs, **arch_dirs}


def check_parity(folder, prompts, outputs):
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == reference(folder, prompt)


# -- greedy: the target's tokens exactly ---------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_ngram_and_draft_give_transformers_tokens_for_every_k(model_dirs, k):
    llama = model_dirs["llama"]
    for spec in ({**NGRAM, "num_tokens": k}, draft(llama, k), draft(model_dirs["qwen2"], k)):
        engine = make_engine(llama, num_kv_blocks=64, speculative=spec)
        check_parity(llama, MIXED, generate(engine, MIXED))
        stats = engine.speculator.stats
        assert stats.proposed > 0 and max(stats.proposed_at) and len(stats.proposed_at) <= k
        if spec.get("model") == str(llama):  # the target as its own draft: all accepted
            assert stats.accepted == stats.proposed


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "mixtral", *ARCHS, *EXTRA])
def test_greedy_speculation_matches_transformers_on_every_architecture(every_dir, name):
    folder, i = every_dir[name], sorted(every_dir).index(name)
    other = every_dir["qwen2" if name == "llama" else "llama"]  # random: mostly rejected
    specs = [{**NGRAM, "num_tokens": 1 + i % 5}, draft(folder if i % 2 else other, 1 + (i + 2) % 5)]
    for spec in specs:
        engine = make_engine(folder, num_kv_blocks=64, speculative=spec)
        check_parity(folder, MIXED, generate(engine, MIXED))
        stats = engine.speculator.stats
        assert stats.proposed > 0
        if spec.get("model") == str(folder):  # its own draft (the draft loop): all kept
            assert stats.accepted == stats.proposed


@pytest.mark.parametrize(
    ("name", "method"),
    [("llama", "ngram"), ("llama", "draft"), ("mistral_window", "ngram"), ("gemma3", "draft")],
)
def test_greedy_exact_under_chunked_prefill_preemption_and_prefix_hits_in_one_batch(
    every_dir, name, method
):
    folder = every_dir[name]  # mistral_window: blocks also freed behind a sliding window
    spec = {**NGRAM, "num_tokens": 3} if method == "ngram" else draft(folder, 4)
    engine = make_engine(folder, num_kv_blocks=12, max_num_batched_tokens=16, speculative=spec)
    generate(engine, SHARED[:1])  # its blocks stay cached: the next batch hits them
    prompts = SHARED + MIXED
    check_parity(folder, prompts, generate(engine, prompts))
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0
    assert engine.speculator.stats.accepted > 0


def test_stop_strings_stop_ids_and_max_tokens_are_exact(model_dirs):
    llama = model_dirs["llama"]
    plain = make_engine(llama, num_kv_blocks=64)
    prompt = "the quick brown fox jumps over the lazy dog the quick"
    full = generate_full(plain, prompt, GREEDY)
    text, token_ids = full.outputs[0].text, full.outputs[0].token_ids
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    greedy = dict(temperature=0, ignore_eos=True)
    cases = [
        SamplingParams(max_tokens=32, stop=[stop], **greedy),
        SamplingParams(max_tokens=32, stop_token_ids=[token_ids[9]], **greedy),
        SamplingParams(max_tokens=7, **greedy),
    ]
    for k in (2, 5):
        engine = make_engine(llama, num_kv_blocks=64, speculative=draft(llama, k))
        for params in cases:  # the target as its draft: stops fall inside accepted runs
            want, got = generate_full(plain, prompt, params), generate_full(engine, prompt, params)
            for field in ("text", "token_ids", "finish_reason", "stop_reason"):
                assert getattr(got.outputs[0], field) == getattr(want.outputs[0], field)
        assert engine.speculator.stats.accepted > 0
    assert full.outputs[0].finish_reason == "length"


def generate_full(engine, prompt, params):
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return final


def test_guided_rows_speculate_within_their_grammar(model_dirs):
    llama = model_dirs["llama"]
    pattern = "(fox|dog) (jumps|sleeps)( over the (lazy|quick) (dog|fox))+"
    params = SamplingParams(temperature=0, max_tokens=24, guide=Guide("regex", pattern))
    plain = make_engine(llama, num_kv_blocks=64)
    engine = make_engine(llama, num_kv_blocks=64, speculative={**NGRAM, "num_tokens": 4})
    prompt = "the quick brown fox jumps over the lazy dog over the lazy dog"
    want, got = generate_full(plain, prompt, params), generate_full(engine, prompt, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert re.fullmatch(f"({pattern})?.*", got.outputs[0].text)
    assert engine.speculator.stats.accepted > 0


# -- sampling: the target's distribution exactly ---------------------------------------------
SMALL_VOCAB = 12
PROMPT = [*range(SMALL_VOCAB), 0, 1, 2]  # every token occurs: n-gram proposals everywhere
POSITIONS = 3


def small_model(folder, seed: int):
    config = LlamaConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    return small_model(root / "target", 0), small_model(root / "draft", 1)


def exact_marginals(folder, temperature: float, top_k: int) -> list[torch.Tensor]:
    """P(token at output position j), j < POSITIONS, by enumerating every prefix with
    transformers' logits (the filter: softmax(logits / T), top-k kept, renormalised)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def next_dist(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(input_ids=prefixes).logits[:, -1].double()
        probs = torch.softmax(logits / temperature, -1)
        kth = probs.topk(top_k, -1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    prefixes, weights = torch.tensor([PROMPT]), torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(POSITIONS):
        dist = next_dist(prefixes)  # [prefixes, vocab]
        marginals.append((weights[:, None] * dist).sum(0))
        weights = (weights[:, None] * dist).flatten()
        prefixes = torch.cat(
            [
                prefixes.repeat_interleave(SMALL_VOCAB, 0),
                torch.arange(SMALL_VOCAB).repeat(len(prefixes))[:, None],
            ],
            1,
        )
    return marginals


N_SAMPLES = 5000


def sampled_positions(folder, spec, temperature, top_k) -> list[list[int]]:
    engine = make_engine(
        folder, num_kv_blocks=600, max_num_seqs=512, speculative={**spec, "max_batch": 1024}
    )
    params = [
        SamplingParams(
            temperature=temperature, top_k=top_k, max_tokens=POSITIONS + 3, ignore_eos=True, seed=i
        )
        for i in range(N_SAMPLES)
    ]
    outputs = generate(engine, [PROMPT] * N_SAMPLES, params)
    stats = engine.speculator.stats  # position 1 comes from the prompt's step
    assert stats.steps > N_SAMPLES and 0 < stats.accepted < stats.proposed
    return [[out[j] for out in outputs] for j in range(POSITIONS)]


def chi_square_p_values(samples, marginals) -> list[float]:
    p_values = []
    for tokens, exact in zip(samples, marginals, strict=True):
        observed = torch.bincount(torch.tensor(tokens), minlength=SMALL_VOCAB).double()
        expected = exact * len(tokens)
        big = expected >= 5  # the rare tokens pooled into one cell
        obs = torch.cat([observed[big], observed[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        if exp[-1] < 5:
            obs, exp = obs[:-1], exp[:-1]
            obs[-1] += observed[~big].sum()
            exp[-1] += expected[~big].sum()
        exp = exp * obs.sum() / exp.sum()
        p_values.append(float(chisquare(obs.numpy(), exp.numpy()).pvalue))
    return p_values


CASES = {  # method: (temperature, top_k, a deliberately wrong rule)
    "ngram": (1.0, SMALL_VOCAB, ("residual", lambda p, q: p)),  # resample from p itself
    "draft": (0.8, 8, ("acceptance", lambda p, q: p)),  # accept with p, ignoring q
    # the draft's head scores 8 of the 12 tokens (q is 0 on 4 the target may draw) and
    # it stops after a token it gave under 0.3
    "draft-restricted": (0.8, 8, ("acceptance", lambda p, q: p)),
}


def token_counts(folder, counts: list[int]) -> None:
    (folder / "token_counts.json").write_text(json.dumps({"counts": counts}))


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-restricted"])
def test_sampled_tokens_follow_the_target_distribution_and_a_wrong_rule_does_not(
    small_dirs, method, monkeypatch
):
    target, other = small_dirs
    temperature, top_k, (name, wrong) = CASES[method]
    spec = {**NGRAM, "num_tokens": 3} if method == "ngram" else draft(other, 3)
    if method == "draft-restricted":
        token_counts(other, [5, 1, 9, 9, 0, 7, 3, 8, 2, 6, 4, 1])  # the top 8: not 1, 4, 8, 11
        spec |= {"draft_vocab": 8, "confidence": 0.3}
    marginals = exact_marginals(target, temperature, top_k)
    right = chi_square_p_values(sampled_positions(target, spec, temperature, top_k), marginals)
    assert min(right) > 1e-3, right
    monkeypatch.setattr(speculative, name, wrong)
    bad = chi_square_p_values(sampled_positions(target, spec, temperature, top_k), marginals)
    assert min(bad) < 1e-6, bad


def test_a_restricted_draft_head_and_a_confidence_stop_keep_greedy_tokens_exact(
    model_dirs, tmp_path
):
    """FR-Spec's head (the draft scores its 64 most frequent tokens) and the draft's
    confidence stop: the target's tokens still, fewer proposals than without."""
    llama, qwen2 = model_dirs["llama"], model_dirs["qwen2"]
    folder = tmp_path / "draft"
    folder.mkdir()
    for path in qwen2.iterdir():
        (folder / path.name).symlink_to(path)
    vocab = json.loads((qwen2 / "config.json").read_text())["vocab_size"]
    token_counts(folder, [(7 * i) % 101 for i in range(vocab)])
    ids = speculative.top_tokens(folder, 64)
    assert ids.tolist() == sorted(sorted(range(vocab), key=lambda i: (-((7 * i) % 101), i))[:64])
    proposed, kept = {}, set(ids.tolist())
    for extra in ({}, {"draft_vocab": 64}, {"draft_vocab": 64, "confidence": 0.9}):
        engine = make_engine(llama, num_kv_blocks=64, speculative=draft(folder, 4, **extra))
        proposer, tokens = engine.speculator.proposer, set()

        def propose(rows, inner=proposer.propose, tokens=tokens):
            out = inner(rows)
            tokens.update(t for proposal, _ in out for t in proposal)
            return out

        proposer.propose = propose
        check_parity(llama, MIXED, generate(engine, MIXED))
        stats = engine.speculator.stats
        proposed[len(extra)] = stats.proposed / stats.steps
        assert tokens and (tokens <= kept) == bool(extra)
    assert proposed[2] < proposed[1]
    with pytest.raises(ValueError, match=r"speculative\.draft_vocab"):  # no counts beside it
        make_engine(llama, num_kv_blocks=16, speculative=draft(qwen2, 4, draft_vocab=64))


def test_a_fixed_seed_gives_the_same_text_twice(model_dirs):
    llama = model_dirs["llama"]
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    for spec in ({**NGRAM, "num_tokens": 4}, draft(model_dirs["qwen2"], 3)):
        runs = []
        for _ in range(2):
            engine = make_engine(llama, num_kv_blocks=64, speculative=spec)
            runs.append(generate(engine, MIXED, params))
            assert engine.speculator.stats.proposed > 0
        assert runs[0] == runs[1]


# -- rollback: nothing leaks -------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_thousand_speculative_requests_leave_the_pool_and_prefix_cache_idle(model_dirs, method):
    llama = model_dirs["llama"]
    spec = {**NGRAM, "num_tokens": 4} if method == "ngram" else draft(model_dirs["qwen2"], 3)
    engine = make_engine(
        llama, num_kv_blocks=48, max_num_batched_tokens=64, speculative={**spec, "max_batch": 64}
    )
    rng = random.Random(0)
    pool = [rng.choices(range(3, 40), k=rng.randint(2, 30)) for _ in range(40)]  # repeats
    submitted, aborted = 0, set()
    while submitted < 1000 or engine.has_unfinished_requests():
        while submitted < 1000 and len(engine.scheduler.running) < 24:
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                max_tokens=rng.randint(1, 12),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=rng.sample(range(3, 40), 2),
            )
            engine.add_request(f"r{submitted}", rng.choice(pool), params)
            submitted += 1
        engine.step()
        if rng.random() < 0.05 and engine.scheduler.running:
            victim = rng.choice(engine.scheduler.running).request_id
            engine.abort_request(victim)
            aborted.add(victim)
    stats = engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed  # rejections, and acceptances
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    cached = {b.block_id: b.hash for b in bm.blocks if b.hash is not None}
    assert cached and {h: b for b, h in cached.items()} == bm.hash_to_block
    assert all(len(bm.blocks[b].token_ids) == bm.block_size for b in cached)
    if method == "draft":
        draft_bm = engine.speculator.proposer.block_manager
        assert not engine.speculator.proposer.mirrors
        assert draft_bm.num_free_blocks == draft_bm.num_blocks
        assert all(b.ref_count == 0 for b in draft_bm.blocks)


def test_cached_blocks_hold_what_their_tokens_compute(model_dirs):
    """A prefix-cache hit after speculative requests gives the tokens of a cold run."""
    llama = model_dirs["llama"]
    engine = make_engine(llama, num_kv_blocks=64, speculative={**NGRAM, "num_tokens": 5})
    first = generate(engine, SHARED[:1])[0]
    again = SHARED[0] + first[:20]  # the cached blocks now include speculated tokens
    check_parity(llama, [again], generate(engine, [again]))
    assert engine.block_manager.prefix_cache_hits >= 48


# -- configuration, opt-out, metrics ---------------------------------------------------------
def test_per_request_opt_out_and_the_metrics(model_dirs):
    llama = model_dirs["llama"]
    engine = make_engine(llama, num_kv_blocks=64, speculative={**NGRAM, "num_tokens": 3})
    opt_out = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, speculative=False)
    check_parity(llama, MIXED, generate(engine, MIXED, opt_out))
    assert engine.speculator.stats.proposed == 0
    generate(engine, MIXED)
    m = engine.metrics()
    assert m.spec_proposed_tokens == engine.speculator.stats.proposed > 0
    assert m.spec_accepted_tokens == sum(m.spec_accepted_per_position)
    assert m.spec_emitted_tokens >= m.spec_accepted_tokens
    # a counter for every position; position j is proposed only after j - 1
    proposed = m.spec_proposed_per_position
    assert len(proposed) == 3 and proposed == sorted(proposed, reverse=True)
    assert sum(proposed) == m.spec_proposed_tokens
    with pytest.raises(SamplingError, match="speculative"):
        SamplingParams(speculative="no")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"num_tokens": 3}, "speculative.method"),
        ({"method": "eagle"}, "speculative.method"),
        ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens"),
        ({"method": "ngram", "num_tokens": "4"}, "speculative.num_tokens"),
        ({"method": "ngram", "k": 4}, "speculative: unknown fields"),
        ({"method": "draft"}, "speculative.model"),
        ({"method": "draft", "model": "no-such-draft"}, "speculative.model"),
        ({"method": "ngram", "confidence": 1.5}, "speculative.confidence"),
        ({"method": "ngram", "draft_vocab": -1}, "speculative.draft_vocab"),
        ({"method": "ngram", "confidence": True}, "speculative.confidence"),
        ({"method": "ngram", "confidence": "0"}, "speculative.confidence"),
        ({"method": "ngram", "confidence": 10**400}, "speculative.confidence"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(model_dirs, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        make_engine(model_dirs["llama"], num_kv_blocks=16, speculative=spec)


def test_an_integer_is_a_float_in_the_speculative_table():
    """TOML's `confidence = 0` is an int: taken as 0.0, as `confidence = 0.0` is."""
    assert (
        speculative.SpeculativeConfig.parse({"method": "ngram", "confidence": 0}, None).confidence
        == 0
    )
    with pytest.raises(ValueError, match=r"speculative.confidence must be in \[0, 1\)"):
        speculative.SpeculativeConfig.parse({"method": "ngram", "confidence": 1}, None)


def test_a_draft_with_another_vocabulary_is_refused(model_dirs, small_dirs):
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(model_dirs["llama"], num_kv_blocks=16, speculative=draft(small_dirs[0], 2))


def test_ngram_proposes_the_tokens_after_the_latest_match():
    config = speculative.SpeculativeConfig("ngram", ngram_min=1, ngram_max=3)
    proposer = speculative.NgramProposer(config)
    assert proposer.lookup([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], 3) == [9, 5, 6]
    assert proposer.lookup([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5]  # a 2-token match: 3 at most
    assert proposer.lookup([5, 6, 7, 8, 5, 6, 7], 4) == [8, 5, 6, 7]
    assert proposer.lookup([1, 2, 3], 2) == []
    assert proposer.lookup([4, 4], 3) == [4]


def test_speculation_is_off_while_more_than_max_batch_requests_run(model_dirs):
    llama = model_dirs["llama"]
    spec = {**NGRAM, "num_tokens": 3, "max_batch": 2}
    engine = make_engine(llama, num_kv_blocks=64, speculative=spec)
    check_parity(llama, MIXED[:3], generate(engine, MIXED[:3]))  # three run the whole time
    assert engine.speculator.stats.proposed == 0
    check_parity(llama, MIXED[:2], generate(engine, MIXED[:2]))
    assert engine.speculator.stats.proposed > 0
    assert speculative.SpeculativeConfig("ngram").max_batch == speculative.MAX_BATCH


def test_logprobs_of_speculated_tokens_are_the_plain_engines(model_dirs):
    llama = model_dirs["llama"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = make_engine(llama, num_kv_blocks=64)
    engine = make_engine(llama, num_kv_blocks=64, speculative=draft(llama, 4))
    prompt = "the quick brown fox jumps over the lazy dog the quick"
    stop_at = generate_full(plain, prompt, greedy).outputs[0].token_ids[6]
    cut = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], logprobs=1)
    for params in (greedy, cut):  # cut: the stop falls inside an accepted run
        want, got = generate_full(plain, prompt, params), generate_full(engine, prompt, params)
        want, got = want.outputs[0], got.outputs[0]
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
        for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
            assert list(mine) == list(theirs)
            assert [mine[t] for t in mine] == pytest.approx([theirs[t] for t in mine], abs=1e-4)
    assert engine.speculator.stats.accepted > 0


# -- LoRA rows: the adapter's greedy tokens, speculated or not ------------------------------
@pytest.mark.parametrize("path", ["c", "grouped", "dense"])  # lora.PATHS
def test_lora_and_base_rows_speculating_in_one_batch_give_transformers_peft_tokens(
    model_dirs, tmp_path, path
):
    from tests.llm.test_lora import make_adapter
    from tests.llm.test_lora import reference as peft_reference

    base = model_dirs["llama"]
    adapters = {
        name: str(make_adapter(base, tmp_path / name, "llama", seed=seed, rank=rank))
        for name, seed, rank in (("a", 1, 4), ("b", 2, 8))
    }
    passage = [1, *range(40, 52)]  # repeated: n-gram proposes from the first copy
    prompts = [[*passage, *passage, 9], [*passage, 300, *passage[:5]], [7, 8, *passage * 2]]
    loras = ["a", None, "b", "a", None, "b"]  # interleaved: adapter and base rows mixed
    prompts = [prompts[i % 3] for i in range(len(loras))]
    new = 40  # long enough for the random model's own output to repeat itself
    want = [
        peft_reference(base, adapters[lora] if lora else None, prompt, new)[0]
        for prompt, lora in zip(prompts, loras, strict=True)
    ]
    for spec in (None, {**NGRAM, "num_tokens": 4}):
        engine = make_engine(
            base, num_kv_blocks=64, max_loras=2, lora_modules=adapters, speculative=spec
        )
        if path == "c" and engine.lora.kernels is None:
            pytest.skip("no C compiler here: the C kernels are not built")
        engine.lora.use_path(path)
        steps = []
        engine.fault_hook = lambda seqs, steps=steps: steps.append({s.lora_id for s in seqs})
        params = [
            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, lora=lora)
            for lora in loras
        ]
        got = generate(engine, prompts, params)
        assert got == want, spec
        assert any(len(s) == 3 for s in steps)  # both adapters and the base in one step
        if spec is not None:
            stats = engine.speculator.stats
            assert stats.proposed > 0 and stats.accepted > 0


def test_ngram_index_proposes_what_a_scan_of_the_sequence_finds():
    """The incremental n-gram index (extended as tokens are appended) against `lookup`,
    which scans the whole sequence, on random sequences over small vocabularies."""
    rng = random.Random(0)
    for low, high in ((1, 3), (2, 5), (1, 1), (3, 4)):
        config = speculative.SpeculativeConfig("ngram", ngram_min=low, ngram_max=high)
        proposer = speculative.NgramProposer(config)
        for vocab in (2, 3, 6):
            seq = Sequence("r", [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))])
            for _ in range(60):
                k = rng.randrange(1, 6)
                [(tokens, q)] = proposer.propose([(seq, k)])
                assert q is None and tokens == proposer.lookup(seq.token_ids, k)
                seq.token_ids += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            proposer.release(seq)
        assert proposer.indexes == {}


@pytest.mark.parametrize("graphs", [True, False])
def test_the_draft_loop_without_the_c_kernels_replayed_or_eager(model_dirs, graphs, monkeypatch):
    """The draft loop (ModelRunner.decode_steps) on the torch path: replaying the CUDA
    graph logic's stand-in (the step buffers moved on in place between replays), or
    eager; the target as its own draft keeps every proposal, tokens are transformers'."""
    from bitserve import kernels
    from bitserve.llm import model_runner
    from tests.llm.test_step_ops import CallGraph

    monkeypatch.setattr(kernels, "get", lambda: None)
    if graphs:
        monkeypatch.setattr(model_runner, "graph_factory", lambda config: CallGraph)
    llama = model_dirs["llama"]
    engine = make_engine(llama, device="cpu", num_kv_blocks=96, speculative=draft(llama, 4))
    replays = []  # the draft's own graphs
    for graph in engine.speculator.proposer.runner.graphs.values():
        graph.replay = lambda graph=graph, replay=graph.replay: replays.append(replay())
    check_parity(llama, MIXED, generate(engine, MIXED))
    assert bool(engine.speculator.proposer.runner.graphs) == graphs
    assert (len(replays) > 0) == graphs
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.accepted == stats.proposed


def test_the_draft_loops_int8_embedding_final_norm_and_head_give_the_forwards_bits(model_dirs):
    """The draft loop's stepper computes an int8 embedding and the final RMSNorm into its
    own buffers, and a restricted int8 head runs its C GEMV on pointers cast once: the
    same bits as the model's forward and the head's own forward."""
    from torch import nn

    from bitserve.llm.model_runner import StepInput
    from bitserve.llm.quant.linear import Int8Embedding, Int8Linear

    llama = model_dirs["llama"]
    engine = make_engine(llama, num_kv_blocks=16, speculative=draft(llama, 4))
    runner = engine.speculator.proposer.runner
    model = runner.model
    model.embed_tokens = Int8Embedding.from_float(model.embed_tokens)
    rows = model.embed_tokens.qweight.float() * model.embed_tokens.scales[:, None]
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    linear.weight.data = rows
    model.lm_head = Int8Linear.from_float(linear)
    ids = torch.arange(0, rows.shape[0], 3)
    speculative.restrict_head(model, ids)
    bs = runner.config.block_size
    step = StepInput(input_ids=[3, 7], positions=[5, 2 * bs + 1], sample_rows=[0, 1])
    tables = [[0, 1, 2], [3, 4, 5]]
    step.slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, step.positions, strict=True)]
    step.decode = (tables, [p + 1 for p in step.positions], [1, 1])
    with torch.inference_mode():
        t = runner.build(step)
        stepper = model.fused_stepper(t.input_ids, t.positions, t.meta)
        assert stepper is not None
        got = stepper().clone()
        want = model(t.input_ids, t.positions, t.meta)
        assert torch.equal(got, want)
        head = model.draft_head
        for _ in range(2):  # the first call prepares the head, the next ones reuse the casts
            assert torch.equal(head.logits(stepper()), model.lm_head(want))
        assert torch.equal(ids[head.logits(want).argmax(-1)], model.compute_logits(want).argmax(-1))
