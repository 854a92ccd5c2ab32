"""Sampling: the batched sampler against the per-row reference (the per-request path it
replaced, with the same seeded draw: the inverse CDF at the row's uniform), frequencies
against the analytic filtered distribution (chi-square), seeds that reproduce whatever
the batch, the same ops for batch 1 and batch 32 with one host read, and every op on
the logits' device."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest
from torch.utils._python_dispatch import TorchDispatchMode

from bitserve.llm import LLM, sampler
from bitserve.llm.sampler import NAN, Sampler, SamplingFailed, row_uniform
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.sequence import Sequence
from bitserve.llm.structured import Guide
from tests.llm.conftest import make_engine
from tests.llm.test_structured import OneDevice

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
DRAWS = 4000


# -- the per-row reference: the per-request sampler this replaced, same draw scheme -------
def apply_penalties(logits: torch.Tensor, seq: Sequence, params: SamplingParams) -> torch.Tensor:
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=logits.shape[-1])
        logits -= params.frequency_penalty * counts.to(logits.dtype)
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1) / sorted_probs.sum()
        drop = cumulative - sorted_probs / sorted_probs.sum() >= params.top_p
        drop[..., 0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def reference(logits: torch.Tensor, seq: Sequence, eos=()) -> int | SamplingFailed:
    params = seq.sampling_params
    if seq.num_output_tokens < params.min_tokens and seq.matcher is None:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
        logits = logits.clone()
        logits[banned] = float("-inf")
    if params.needs_penalties:
        logits = apply_penalties(logits, seq, params)
    if params.greedy:
        value, token = logits.max(-1)
        return SamplingFailed(NAN) if value.isnan() else int(token)
    probs = filter_probs(torch.softmax(logits / params.temperature, dim=-1), params)
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0:
        return SamplingFailed("invalid")
    cdf = probs.double().cumsum(-1)  # the first token whose cdf reaches u x sum
    return int((cdf < row_uniform(params.seed, seq.num_output_tokens) * cdf[-1]).sum())


def reference_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    logprobs = torch.log_softmax(logits, dim=-1)
    result = {token: float(logprobs[token])}
    values, ids = torch.topk(logprobs, min(n, len(logprobs)))
    for value, idx in zip(values.tolist(), ids.tolist(), strict=True):
        result.setdefault(idx, value)
    return result


def random_seq(rng: random.Random, i: int, vocab: int) -> Sequence:
    greedy = rng.random() < 0.3
    params = SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.7]),
        top_k=rng.choice([-1, -1, 1, 3, 10, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7]),
        presence_penalty=rng.choice([0.0, 0.0, 0.8, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4, -1.0]),
        min_tokens=rng.choice([0, 0, 4]),
        stop_token_ids=rng.choice([[], [5, 9]]),
        seed=rng.randrange(-(2**63), 2**63),
        logprobs=rng.choice([None, None, 0, 3]),
    )
    seq = Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 8))], params)
    for _ in range(rng.randint(0, 6)):
        seq.append_token(rng.randrange(vocab))
    return seq


def test_batched_equals_the_per_row_reference_for_seeded_rows():
    for trial in range(4):
        rng, vocab = random.Random(trial), 64
        seqs = [random_seq(rng, i, vocab) for i in range(48)]
        logits = torch.randn(48, vocab, generator=torch.Generator().manual_seed(trial)) * 2
        logits[7, 3] = float("nan")
        logits[11] = float("-inf")  # nothing to draw: a sampled row fails, a greedy one is 0
        raw = logits.clone()
        tokens = Sampler()(logits, seqs, eos_token_ids={2})
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            want = reference(raw[i], seq, eos={2})
            if isinstance(want, SamplingFailed):
                assert isinstance(token, SamplingFailed), (trial, i, seq.sampling_params)
                continue
            assert token == want, (trial, i, seq.sampling_params)
            if seq.sampling_params.logprobs is not None:
                (got,) = seq.logprobs
                expected = reference_logprobs(raw[i], token, seq.sampling_params.logprobs)
                assert list(got) == list(expected)
                values = pytest.approx(list(expected.values()), rel=1e-6, nan_ok=True)
                assert list(got.values()) == values
        assert isinstance(tokens[7], SamplingFailed) and str(tokens[7]) == NAN


def test_greedy_rows_are_the_argmax():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(3))
    seqs = [
        Sequence(f"s{i}", [1], SamplingParams(temperature=0.0 if i % 3 else 1.0, logprobs=i % 2))
        for i in range(32)
    ]
    tokens = Sampler()(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    assert all(tokens[i] == argmax[i] for i in range(32) if i % 3)


def draws(params: SamplingParams, logits=LOGITS, seeded=True, history=()) -> np.ndarray:
    """DRAWS rows at once, each its own request (its own seed, or unseeded)."""
    seqs = []
    for i in range(DRAWS):
        seq = Sequence(
            f"s{i}", [0], SamplingParams(**{**vars(params), "seed": i if seeded else None})
        )
        for t in history:
            seq.append_token(t)
        seqs.append(seq)
    tokens = Sampler()(logits.repeat(DRAWS, 1), seqs)
    return np.bincount(tokens, minlength=len(logits))


def analytic(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The textbook filters in float64: the k largest, the smallest prefix (by
    probability) holding top_p, the tokens of at least min_p x the largest."""
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    keep = np.ones(len(p), bool)
    order = np.argsort(-p)
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    before = np.cumsum(q[order]) - q[order]  # the mass above each token
    keep[order[before >= top_p]] = False
    keep &= p >= min_p * p.max()
    return np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()


def assert_frequencies(counts: np.ndarray, probs: np.ndarray) -> None:
    assert counts[probs == 0].sum() == 0
    assert chisquare(counts[probs > 0], probs[probs > 0] * counts.sum()).pvalue > 1e-3


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (dict(temperature=1.0), [0, 1, 2, 3, 4, 5]),
        (dict(temperature=0.7, top_k=3), [0, 1, 2]),
        (dict(top_p=0.7), [0, 1, 2]),  # cumulative 0.39, 0.63, 0.78: the third crosses 0.7
        (dict(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * p_max = e^{-1.2} of the top
    ],
)
def test_sampling_frequencies_match_the_filtered_distribution(params, keep):
    expected = analytic(LOGITS.double().numpy(), **params)
    assert expected.nonzero()[0].tolist() == keep
    for seeded in (True, False):
        assert_frequencies(draws(SamplingParams(**params), seeded=seeded), expected)


def test_all_filters_and_penalties_together_match_the_analytic_distribution():
    logits = torch.tensor([3.0, 2.4, 2.2, 1.9, 1.5, 1.0, 0.2, -0.5])
    params = SamplingParams(
        temperature=0.8, top_k=6, top_p=0.9, min_p=0.35,
        repetition_penalty=1.25, frequency_penalty=0.2, presence_penalty=0.3,
    )  # fmt: skip
    history = [0, 0, 6]  # prompt [0], outputs 0, 0, 6
    adjusted = logits.double().numpy().copy()
    for t in (0, 6):  # seen: divided (positive) or multiplied (negative) by 1.25
        adjusted[t] = adjusted[t] / 1.25 if adjusted[t] > 0 else adjusted[t] * 1.25
    adjusted[0] -= 0.2 * 2 + 0.3  # twice in the output
    adjusted[6] -= 0.2 * 1 + 0.3
    expected = analytic(adjusted, 0.8, top_k=6, top_p=0.9, min_p=0.35)
    # penalised, token 0 is 4th; top-k drops 6, 7; top-p then 5; min-p 4 (p4 = 0.32 p1)
    assert expected.nonzero()[0].tolist() == [0, 1, 2, 3]
    assert_frequencies(draws(params, logits, history=history), expected)


def test_top_p_keeps_the_first_token_even_if_it_alone_passes():
    assert draws(SamplingParams(top_p=0.01)).tolist() == [DRAWS, 0, 0, 0, 0, 0]


def test_seeded_uniforms_are_uniform_over_positions_and_seeds():
    over_positions = [row_uniform(7, position) for position in range(5000)]
    over_seeds = [row_uniform(seed, 3) for seed in range(-2500, 2500)]
    for values in (over_positions, over_seeds):
        assert min(values) > 0.0 and max(values) < 1.0
        assert kstest(values, "uniform").pvalue > 1e-3
    assert row_uniform(7, 0) == row_uniform(7, 0) != row_uniform(7, 1)


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(5))
    rng = random.Random(1)

    def seq(i: int, seed: int | None, outputs: int) -> Sequence:
        s = Sequence(f"s{i}", [1, 2], SamplingParams(seed=seed, top_k=50))
        for _ in range(outputs):
            s.append_token(rng.randrange(300))
        return s

    alone = [Sampler()(logits[i : i + 1], [seq(i, 7, i)])[0] for i in range(40)]
    mixed = [seq(i, 7, i) if i % 2 else seq(i, None, 3) for i in range(40)]
    together = Sampler()(logits.flip(0), mixed[::-1])[::-1]
    assert [together[i] for i in range(1, 40, 2)] == [alone[i] for i in range(1, 40, 2)]
    other = [Sampler()(logits[i : i + 1], [seq(i, 8, i)])[0] for i in range(40)]
    assert other != alone


def test_penalties_of_the_reference():
    seq = Sequence("s", [0, 1], SamplingParams(repetition_penalty=2.0))
    seq.append_token(1)
    seq.append_token(1)
    logits = apply_penalties(LOGITS, seq, seq.sampling_params)
    assert logits[0] == 1.0 and logits[1] == 0.75 and logits[2] == 1.0
    assert apply_penalties(-LOGITS, seq, seq.sampling_params)[0] == -4.0
    seq.sampling_params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    logits = apply_penalties(LOGITS, seq, seq.sampling_params)
    assert logits[1] == pytest.approx(1.5 - 0.5 - 0.5)  # output has token 1 twice
    assert logits[0] == 2.0  # prompt-only tokens are not penalised


def test_penalties_move_the_greedy_token():
    for params, token in [
        (dict(repetition_penalty=2.5), 2),  # 0 and 1 seen: 2.0 -> 0.8, 1.5 -> 0.6
        (dict(repetition_penalty=0.5), 0),  # 2.0 -> 4.0 stays first
        (dict(frequency_penalty=-1.0), 1),  # output 1 twice: 1.5 + 2 > 2.0
        (dict(presence_penalty=-1.0), 1),  # 1.5 + 1 > 2.0
        (dict(frequency_penalty=-0.2, presence_penalty=-0.05), 0),  # 1.5 + 0.45 < 2.0
        (dict(frequency_penalty=-0.2, presence_penalty=-0.15), 1),  # 1.5 + 0.55 > 2.0
    ]:
        seq = Sequence("s", [0], SamplingParams(temperature=0, **params))
        seq.append_token(1)
        seq.append_token(1)
        assert Sampler()(LOGITS[None].clone(), [seq]) == [token], params


def test_min_tokens_suppresses_eos_and_stop_ids():
    seq = Sequence("s", [0], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]))
    assert Sampler()(LOGITS[None], [seq], {0}) == [2]
    seq.append_token(2)
    seq.append_token(2)
    assert Sampler()(LOGITS[None], [seq], {0}) == [0]


# -- no op per row, one host read, one device -------------------------------------------
class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")
KINDS = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.2, logprobs=2),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1, logprobs=3),
    dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.2),
    dict(temperature=1.0, top_p=0.5, min_tokens=4, stop_token_ids=[3]),
]


def count(kinds: list[dict], vocab=500) -> tuple[Counter, int]:
    seqs = []
    for i, kind in enumerate(kinds):
        seq = Sequence(f"s{i}", list(range(i % 7 + 1)), SamplingParams(**kind))
        for t in range(i % 5 + 1):
            seq.append_token(t)
        seqs.append(seq)
    logits = torch.randn(len(kinds), vocab)
    reads = []

    def counted(packed):
        reads.append(packed.shape)
        return host(packed)

    host, sampler.to_host = sampler.to_host, counted
    try:
        with CountOps() as mode:
            tokens = Sampler()(logits, seqs, {2})
    finally:
        sampler.to_host = host
    assert not any(isinstance(t, SamplingFailed) for t in tokens)
    assert not [op for op in mode.ops if op.startswith(READS)]
    return mode.ops, len(reads)


def test_batch_1_and_batch_32_take_the_same_ops_and_one_read():
    for kind in KINDS:
        one, reads_one = count([kind])
        many, reads_many = count([kind] * 32)
        assert one == many and reads_one == reads_many == 1, kind


def test_a_mixed_batch_of_32_takes_the_ops_of_one_row_of_each_kind():
    few, _ = count(KINDS)
    many, reads = count([KINDS[i % len(KINDS)] for i in range(32)])
    assert few == many and reads == 1


def test_the_sampler_stays_on_the_logits_device(monkeypatch):
    """On `meta`, under a mode refusing any op that mixes devices; the one read is the
    only thing that cannot run there (it is faked)."""
    monkeypatch.setattr(sampler, "to_host", lambda packed: [0.0] * packed.numel())
    seqs = [Sequence(f"s{i}", [1, 2], SamplingParams(**KINDS[i % 5])) for i in range(10)]
    guided = Sequence("g", [1, 2], SamplingParams(temperature=0.5))
    guided.matcher = object()  # its mask is given: the matcher is never asked
    bitmask = torch.full((1, (500 + 31) // 32), -1, dtype=torch.int32)
    logits = torch.empty(11, 500, device="meta")
    with OneDevice():
        Sampler()(logits, [*seqs, guided], {2}, ({id(guided): 0}, bitmask))
        prompt = Sequence("p", [1, 2, 3, 4], SamplingParams(prompt_logprobs=2))
        Sampler.prompt_logprobs(prompt, 1, torch.empty(3, 500, device="meta"))


# -- through the engine ----------------------------------------------------------------------
def test_seeded_generation_through_the_engine_is_reproducible(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=64)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params)][::-1]
    assert first == again
    others = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=16, ignore_eos=True)
    crowd = llm.generate([*prompts, [3, 4], [12, 13, 14]], [params, params, others, others])
    assert [o.outputs[0].token_ids for o in crowd[:2]] == first


def test_a_sampler_that_raises_fails_only_its_request(llama_dir):
    """Sampling runs outside the forward pass's isolation: the engine then samples each
    row alone, and the row that still raises fails its request alone."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12]]
    clean = LLM.__new__(LLM)
    clean.engine = make_engine(llama_dir, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in clean.generate(prompts, greedy)]
    engine = make_engine(llama_dir, num_kv_blocks=64)
    real = engine.sampler

    def broken(logits, seqs, *args):
        if any(s.request_id == "r1" and s.num_output_tokens == 2 for s in seqs):
            raise RuntimeError("Expected all tensors to be on the same device")
        return real(logits, seqs, *args)

    engine.sampler = broken
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy)
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert "same device" in finals["r1"].error and finals["r1"].outputs[0].finish_reason == "error"
    assert [finals[r].outputs[0].token_ids for r in ("r0", "r2")] == [want[0], want[2]]
    assert engine.requests_failed_total == 1 and engine.block_manager.usage() == 0.0


def test_a_grammar_mask_that_raises_fails_only_its_request(llama_dir):
    """The masks are computed on another thread during the forward pass; a matcher that
    breaks there fails its own request, and the step's other requests go on."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = make_engine(llama_dir, num_kv_blocks=64)
    engine.add_request("plain", [5, 6, 7], greedy)
    guided = SamplingParams(max_tokens=4, seed=1, guide=Guide.choice(["yes", "no"]))
    engine.add_request("guided", [8, 9], guided)
    engine.add_request("broken", [8, 9], guided)
    engine.requests["broken"].seq.matcher = "not a matcher"  # llguidance refuses it
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    assert finals["broken"].outputs[0].finish_reason == "error" and finals["broken"].error
    assert finals["plain"].error is None and len(finals["plain"].outputs[0].token_ids) == 4
    assert finals["guided"].error is None and finals["guided"].outputs[0].text in ("yes", "no")
