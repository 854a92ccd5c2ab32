"""Sampling: filters match their expected distributions (chi-square), seeds reproduce."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from bitserve.llm import LLM
from bitserve.llm.sampler import Sampler, apply_penalties, filter_probs, sample_one
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.sequence import Sequence
from tests.llm.conftest import make_engine

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
DRAWS = 4000


def draw(params: SamplingParams, n=DRAWS) -> torch.Tensor:
    seq = Sequence("s", [0], params)
    counts = torch.zeros(len(LOGITS))
    for _ in range(n):
        counts[sample_one(LOGITS, seq)] += 1
    return counts


def expected(keep: list[int], temperature=1.0) -> torch.Tensor:
    probs = torch.softmax(LOGITS / temperature, -1)
    mask = torch.zeros_like(probs)
    mask[keep] = 1
    probs = probs * mask
    return probs / probs.sum() * DRAWS


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
    params = SamplingParams(seed=123, **params)
    counts = draw(params)
    exp = expected(keep, params.temperature)
    assert counts[exp == 0].sum() == 0
    observed, wanted = counts[exp > 0].numpy(), exp[exp > 0].numpy()
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_top_p_keeps_the_first_token_even_if_it_alone_passes():
    probs = torch.softmax(LOGITS, -1)
    kept = filter_probs(probs, SamplingParams(top_p=0.01))
    assert kept.nonzero().flatten().tolist() == [0]


def test_same_seed_same_tokens_and_different_seed_differs():
    a = draw(SamplingParams(seed=5), n=200)
    b = draw(SamplingParams(seed=5), n=200)
    c = draw(SamplingParams(seed=6), n=200)
    assert torch.equal(a, b)
    seq1, seq2 = (
        Sequence("x", [0], SamplingParams(seed=5)),
        Sequence("y", [0], SamplingParams(seed=6)),
    )
    run1 = [sample_one(LOGITS, seq1) for _ in range(50)]
    run2 = [sample_one(LOGITS, seq2) for _ in range(50)]
    assert run1 != run2 or not torch.equal(a, c)


def test_penalties():
    seq = Sequence("s", [0, 1], SamplingParams(repetition_penalty=2.0))
    seq.append_token(1)
    seq.append_token(1)
    logits = apply_penalties(LOGITS, seq, seq.sampling_params)
    assert logits[0] == 1.0 and logits[1] == 0.75 and logits[2] == 1.0
    neg = apply_penalties(-LOGITS, seq, seq.sampling_params)
    assert neg[0] == -4.0
    seq.sampling_params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    logits = apply_penalties(LOGITS, seq, seq.sampling_params)
    assert logits[1] == pytest.approx(1.5 - 0.5 - 0.5)  # output has token 1 twice
    assert logits[0] == 2.0  # prompt-only tokens are not penalised


def test_min_tokens_suppresses_eos_and_stop_ids():
    seq = Sequence("s", [0], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]))
    assert sample_one(LOGITS, seq, eos_token_ids={0}) == 2
    tokens = Sampler()(LOGITS[None], [seq], {0})
    assert tokens == [2]


def test_seeded_generation_through_the_engine_is_reproducible(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=64)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=16, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params)][::-1]
    assert first == again
