"""No request can take the engine down: a fault inside a step fails the request that
caused it, and the batch's other requests finish with the tokens they would have had.
If the step loop dies anyway, `revive()` serves again over the same weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bitserve.llm import SamplingParams
from bitserve.llm.async_engine import AsyncLLMEngine, EngineDead, RequestFailed
from bitserve.llm.sampler import Sampler, SamplingFailed
from bitserve.llm.sequence import Sequence
from tests.llm.conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45], [100, 3, 4]]


class Boom(RuntimeError):
    pass


def run(engine, prompts, params=GREEDY) -> dict[str, object]:
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return {i: finals[i] for i in ids}


def test_a_fault_in_a_step_fails_only_its_request(llama_dir):
    clean = run(make_engine(llama_dir), PROMPTS)
    engine = make_engine(llama_dir)
    calls = []

    def hook(seqs: list[Sequence]) -> None:
        calls.append(len(seqs))
        if any(s.request_id == "r2" and s.num_output_tokens == 3 for s in seqs):
            raise Boom("injected")

    engine.fault_hook = hook
    faulty = run(engine, PROMPTS)
    assert faulty["r2"].error is not None and "Boom: injected" in faulty["r2"].error
    assert faulty["r2"].outputs[0].finish_reason == "error"
    for rid in ("r0", "r1", "r3"):
        assert faulty[rid].error is None
        assert faulty[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert max(calls) == 4 and 1 in calls  # the batched step, then one request at a time
    assert engine.requests_failed_total == 1 and not engine.requests


def test_a_row_the_sampler_cannot_sample_fails_alone():
    seqs = [Sequence(f"s{i}", [1, 2], SamplingParams(temperature=1.0, seed=i)) for i in range(3)]
    logits = torch.randn(3, 16)
    logits[1, 4] = float("nan")
    tokens = Sampler()(logits, seqs)
    assert isinstance(tokens[1], SamplingFailed)
    assert all(isinstance(t, int) for t in (tokens[0], tokens[2]))
    logits = torch.full((1, 16), float("-inf"))  # nothing left to draw
    assert isinstance(Sampler()(logits, seqs[:1])[0], SamplingFailed)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 5e-324), ("top_p", 5e-324), ("temperature", 0.004), ("min_p", 1.0)],
)
def test_extreme_in_range_values_complete(llama_dir, field, value):
    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=8, seed=3, ignore_eos=True, **{field: value})
    out = run(engine, PROMPTS[:2], params)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 8 for o in out.values())


def test_out_of_vocabulary_ids_are_refused_at_admission(llama_dir):
    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**8])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("x", [5, 6], params)
    assert not engine.has_unfinished_requests()


async def test_a_dead_loop_fails_every_request_then_revives(llama_dir):
    engine = AsyncLLMEngine(llama_dir)
    try:
        died = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine.on_death = lambda _: loop.call_soon_threadsafe(died.set)

        def kill(seqs):
            raise SystemExit("the step loop is killed")  # not an Exception: not isolated

        engine.engine.fault_hook = kill
        with pytest.raises(EngineDead):
            async for _ in engine.generate([5, 6, 7], GREEDY):
                pass
        await asyncio.wait_for(died.wait(), 5)
        assert engine.dead is not None
        with pytest.raises(EngineDead):  # refused, never queued on a dead loop
            async for _ in engine.generate([5, 6, 7], GREEDY):
                pass
        engine.engine.fault_hook = None
        await asyncio.to_thread(engine.revive)
        assert engine.dead is None
        outs = [o async for o in engine.generate([5, 6, 7], GREEDY)]
        assert len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens
        assert engine.engine.block_manager.usage() == 0.0
    finally:
        engine.shutdown()


async def test_a_failed_request_raises_to_its_caller_alone(llama_dir):
    engine = AsyncLLMEngine(llama_dir)
    try:

        def hook(seqs):
            if any(s.prompt_token_ids[0] == 99 for s in seqs):
                raise Boom("this prompt breaks the model")

        engine.engine.fault_hook = hook

        async def collect(prompt):
            return [o async for o in engine.generate(prompt, GREEDY)][-1]

        results = await asyncio.gather(
            collect([5, 6, 7]), collect([99, 6, 7]), collect([8, 9]), return_exceptions=True
        )
        assert isinstance(results[1], RequestFailed) and "Boom" in str(results[1])
        assert all(r.finished and r.error is None for r in (results[0], results[2]))
        assert engine.dead is None
    finally:
        engine.shutdown()
