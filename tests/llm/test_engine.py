"""Token-exact parity with transformers' greedy `generate`, under every scheduling path.

The reference is transformers' `generate(do_sample=False)` on each prompt alone; the
engine runs the prompts together (mixed lengths), then again with a pool so small
that requests are preempted, with 16-token prefill chunks, with shared prefixes and
prefix caching on and off, and with requests joining a running batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bitserve.llm import LLM, RequestTooLong, SamplingParams
from tests.llm.conftest import make_engine

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MODELS = ["llama", "qwen2", "gpt2", "mixtral"]


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


MIXED = random_prompts([3, 17, 40, 64, 100])
PREFIX = random_prompts([48], seed=7)[0]
SHARED = [PREFIX + tail for tail in random_prompts([5, 20, 33], seed=8)]


_references: dict[tuple, list[int]] = {}


def reference(model_dir, prompt) -> list[int]:
    key = (str(model_dir), tuple(prompt))
    if key not in _references:
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
        _references[key] = out[0, len(prompt) :].tolist()
    return _references[key]


def generate(engine, prompts, params=GREEDY):
    llm = LLM.__new__(LLM)
    llm.engine = engine
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_parity(model_dir, prompts, outputs):
    for prompt, got in zip(prompts, outputs, strict=True):
        want = reference(model_dir, prompt)
        assert len(want) == NEW_TOKENS
        assert got == want


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers_on_a_mixed_batch(model_dirs, name):
    engine = make_engine(model_dirs[name], num_kv_blocks=64)
    assert_parity(model_dirs[name], MIXED, generate(engine, MIXED))


@pytest.mark.parametrize("name", MODELS)
def test_parity_when_the_pool_is_so_small_that_requests_are_preempted(model_dirs, name):
    engine = make_engine(model_dirs[name], num_kv_blocks=12)  # the longest needs 9 blocks
    assert_parity(model_dirs[name], MIXED, generate(engine, MIXED))
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", MODELS)
def test_parity_with_16_token_prefill_chunks(model_dirs, name):
    engine = make_engine(model_dirs[name], num_kv_blocks=64, max_num_batched_tokens=16)
    assert_parity(model_dirs[name], MIXED, generate(engine, MIXED))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("caching", [True, False])
def test_parity_with_shared_prefixes(model_dirs, name, caching):
    engine = make_engine(model_dirs[name], num_kv_blocks=64, enable_prefix_caching=caching)
    outputs = [generate(engine, [prompt])[0] for prompt in SHARED]  # one after another
    outputs += generate(engine, SHARED)  # and together
    assert_parity(model_dirs[name], SHARED + SHARED, outputs)
    hits = engine.block_manager.prefix_cache_hits
    assert hits >= 5 * 48 if caching else hits == 0


@pytest.mark.parametrize("name", MODELS)
def test_parity_for_requests_added_while_others_run(model_dirs, name):
    engine = make_engine(model_dirs[name], num_kv_blocks=64, max_num_batched_tokens=32)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(MIXED))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert_parity(model_dirs[name], MIXED, [results[str(i)] for i in range(len(MIXED))])


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_transformers_log_softmax(llama_dir, chunk):
    engine = make_engine(llama_dir, num_kv_blocks=64, max_num_batched_tokens=chunk)
    prompt = MIXED[3]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3, logprobs=2)
    out = LLM.__new__(LLM)
    out.engine = engine
    result = out.generate([prompt], params)[0]
    hf = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = result.prompt_logprobs[position]
        expected = logprobs[position - 1]
        assert entry[prompt[position]] == pytest.approx(float(expected[prompt[position]]), abs=1e-4)
        top = torch.topk(expected, 3).indices.tolist()
        assert set(top) <= set(entry)
    sampled = result.outputs[0].token_ids[0]
    assert sampled == int(logprobs[-1].argmax())
    assert result.outputs[0].logprobs[0][sampled] == pytest.approx(
        float(logprobs[-1].max()), abs=1e-4
    )


def test_requests_that_can_never_fit_are_refused_at_admission(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=4, max_model_len=256)
    with pytest.raises(RequestTooLong, match="max_model_len"):
        engine.add_request("a", list(range(3, 250)), SamplingParams(max_tokens=16))
    with pytest.raises(RequestTooLong, match="KV blocks"):
        engine.add_request("b", list(range(3, 70)), SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("c", [], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_abort_frees_the_blocks_at_once(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=64)
    engine.add_request("long", MIXED[4], GREEDY)
    engine.add_request("other", MIXED[1], GREEDY)
    engine.step()
    held = engine.block_manager.num_free_blocks
    engine.abort_request("long")
    assert engine.block_manager.num_free_blocks == held + 7  # 100 + 1 tokens -> 7 blocks
    while engine.has_unfinished_requests():
        engine.step()


def test_text_prompts_stop_strings_and_eos(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=64)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    free = llm.generate(
        "the quick brown fox", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    text = free.outputs[0].text
    assert text and free.outputs[0].finish_reason == "length"
    stop = text[5:8]
    cut = llm.generate(
        "the quick brown fox",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
    )[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == text[: text.find(stop)]
    first = free.outputs[0].token_ids[3]
    by_id = llm.generate(
        "the quick brown fox",
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first], ignore_eos=True),
    )[0]
    assert by_id.outputs[0].token_ids[-1] == first
    assert len(by_id.outputs[0].token_ids) <= 4


def test_metrics_snapshot(model_dirs):
    engine = make_engine(model_dirs["mixtral"], num_kv_blocks=64)
    generate(engine, SHARED[:2])
    m = engine.metrics()
    assert m.num_requests_running == m.num_requests_waiting == 0
    assert m.generation_tokens_total == 2 * NEW_TOKENS
    assert m.prefix_cache_queries > 0
    assert sum(m.tokens_per_expert) > 0 and len(m.tokens_per_expert) == 4
