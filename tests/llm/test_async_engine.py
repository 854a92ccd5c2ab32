"""The async engine: streams tokens, runs apart from the event loop, aborts free blocks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

import bitserve.llm.engine as engine_module
from bitserve.llm import LLMEngine, SamplingParams
from bitserve.llm.async_engine import AsyncLLMEngine
from tests.llm.test_engine import GREEDY, MIXED, reference


@pytest.fixture
def engine(llama_dir):
    engine = AsyncLLMEngine(llama_dir, num_kv_blocks=64)
    yield engine
    engine.shutdown()
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


async def collect(engine, prompt, params, request_id):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


async def test_concurrent_streams_match_transformers(engine, llama_dir):
    results = await asyncio.gather(
        *(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(MIXED))
    )
    for prompt, outputs in zip(MIXED, results, strict=True):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert len(outputs) > 1  # streamed, not one final answer
        assert outputs[-1].outputs[0].token_ids == reference(llama_dir, prompt)


async def test_the_event_loop_keeps_running_while_the_engine_works(engine):
    """Every step runs on the engine's own thread, never on the event loop's, and the
    loop serves other work while a step runs (shown with a step held on purpose, so
    the check does not depend on how fast the machine is)."""
    original = engine.engine.step
    step_threads: set[int] = set()
    running = threading.Event()
    release = threading.Event()

    def step():
        step_threads.add(threading.get_ident())
        running.set()
        release.wait(5)
        return original()

    engine.engine.step = step
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        generation = asyncio.create_task(collect(engine, MIXED[4], params, "long"))
        await asyncio.to_thread(running.wait, 5)
        assert running.is_set() and not generation.done()
        ticks = 0
        for _ in range(5):  # the loop is free while the engine sits inside a step
            await asyncio.sleep(0)
            ticks += 1
        release.set()
        outputs = await generation
    finally:
        engine.engine.step = original
        release.set()
    assert ticks == 5 and outputs[-1].finished
    assert step_threads and threading.get_ident() not in step_threads


async def test_abort_frees_blocks_and_ends_the_stream(engine):
    """Each step is slowed to 20 ms, so the 200 tokens cannot all be made between the
    first one and the abort however fast the machine (CI once finished them first)."""
    original = engine.engine.step

    def slow_step():
        time.sleep(0.02)
        return original()

    engine.engine.step = slow_step
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stream = engine.generate(MIXED[4], params, "victim")
    try:
        first = await anext(stream)
        assert not first.finished
        await engine.abort("victim")
    finally:
        engine.engine.step = original
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # freed before abort() returned
    rest = [out async for out in stream]
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


async def test_leaving_the_stream_early_aborts_the_request(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with contextlib.aclosing(engine.generate(MIXED[2], params, "gone")) as stream:
        async for _ in stream:
            break  # the server closes the stream when the client disconnects
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.engine.has_unfinished_requests()


async def test_a_bad_request_fails_at_once(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, [5] * 500, SamplingParams(max_tokens=100), "too-long")


async def test_a_burst_of_requests_during_a_step_starts_together(engine):
    """Requests that arrive while a step runs are tokenized and handed over without
    waiting for it, and the next step takes them all (behind the step's lock they were
    admitted a few a step). Shown with a step held on purpose, as above."""
    original = engine.engine.step
    sizes: list[int] = []
    running, release = threading.Event(), threading.Event()

    def step():
        running.set()
        release.wait(5)
        out = original()
        sizes.append(len(engine.engine.scheduler.running))
        return out

    engine.engine.step = step
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = asyncio.create_task(collect(engine, MIXED[0], params, "first"))
    try:
        await asyncio.to_thread(running.wait, 5)
        running.clear()
        burst = [
            asyncio.create_task(collect(engine, p, params, f"burst{i}"))
            for i, p in enumerate(MIXED[1:])
        ]
        # every request is queued while the step is still held
        for _ in range(500):
            with engine._pending_lock:
                if len(engine._pending) == len(burst):
                    break
            await asyncio.sleep(0.01)
        assert len(engine._pending) == len(burst) and not first.done()
    finally:
        release.set()
    await asyncio.gather(first, *burst)
    assert sizes[1] == 1 + len(burst)  # the step after the held one ran them all


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "decoding"])
async def test_new_prompts_wait_for_the_burst_behind_them(llama_dir, monkeypatch, busy):
    """A client sends a wave of requests at once; the first ones wake the engine (idle,
    or between decode steps), the rest are still being parsed. With batch_wait the step
    that starts the first ones waits a share of their predicted prefill time and takes
    the whole wave; without it the first ones' step runs and the rest wait it out."""
    monkeypatch.setattr(engine_module, "MAX_BATCH_WAIT_S", 1.0)  # room for a slow CI box
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    wave = [f"w{i}" for i in range(len(MIXED) - 1)]
    for batch_wait, together in ((1.0, True), (0.0, False)):
        engine = AsyncLLMEngine(llama_dir, num_kv_blocks=64, batch_wait=batch_wait)
        original, prompts, started = engine.engine.run, [], threading.Event()

        def run(batch, original=original, prompts=prompts, started=started):
            new = {seq.request_id for seq, n in batch.scheduled if seq.num_computed_tokens == 0}
            if new & set(wave):
                started.set()
                prompts.append(new)
            return original(batch)

        engine.engine.run = run
        try:
            if busy:  # a request decoding the whole time
                runner = engine.generate(MIXED[4], long, "runner")
                await anext(runner)
            engine.engine.seconds_per_prompt_token = 1.0  # as if measured: 1 s a token
            first = asyncio.create_task(collect(engine, MIXED[0], params, wave[0]))
            if batch_wait == 0:  # the first one's step has begun
                await asyncio.to_thread(started.wait, 5)
            else:
                await asyncio.sleep(0.05)
            pairs = zip(wave[1:], MIXED[1:4], strict=True)
            rest = [collect(engine, p, params, r) for r, p in pairs]
            await asyncio.gather(first, *rest)
            if busy:
                await runner.aclose()  # aborts it
        finally:
            engine.shutdown()
        assert (prompts[0] == set(wave)) == together


def test_batch_wait_is_a_share_of_the_predicted_prefill_and_bounded(llama_dir):
    engine = LLMEngine(llama_dir, num_kv_blocks=16, batch_wait=0.05)
    assert engine.batch_wait(100) == 0.0  # nothing timed yet: never wait blind
    engine.seconds_per_prompt_token = 2e-3
    assert engine.batch_wait(100) == pytest.approx(0.05 * 100 * 2e-3)
    assert engine.batch_wait(100_000) == engine_module.MAX_BATCH_WAIT_S
    for bad in (2, -0.1, float("nan"), float("inf"), "0.1", None, [0.05]):
        with pytest.raises(ValueError, match="batch_wait"):
            LLMEngine(llama_dir, num_kv_blocks=16, batch_wait=bad)
