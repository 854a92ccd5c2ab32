"""Tensor and pipeline parallelism on CPU with gloo: worker processes started by the
engine, greedy tokens identical to one process, loud failures instead of hangs.

Each parity test builds one parallel engine (a spawned worker group costs ~3 s) and
runs several scheduling paths through it: a mixed batch with 32-token chunks and a
pool small enough to preempt, then shared prefixes one after another. Then: workers
as Ray actors in a placement group, the server's async engine and a model's
config.toml over workers, and workers killed or stopped mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import signal
import time
import types

import pytest
import torch

from bitserve.llm import LLM, SamplingParams, model_runner
from bitserve.llm.config import EngineConfig
from bitserve.llm.engine import LLMEngine
from bitserve.llm.model_runner import micro_batch_count, split_micro_batches
from bitserve.llm.parallel import stage_layers
from bitserve.llm.workers import WorkerDied
from tests.llm.conftest import _engines
from tests.llm.test_engine import MIXED, MODELS, SHARED, generate

ENGINE = dict(num_kv_blocks=12, max_num_batched_tokens=32)  # preempts and chunks


@pytest.fixture
def parallel_engine():
    """Build engines whose workers are always stopped after the test."""
    engines: list[LLMEngine] = []

    def make(path, **kwargs) -> LLMEngine:
        engine = LLMEngine(path, **kwargs)
        engines.append(engine)
        _engines.append(engine)  # conftest: the pool must be whole after the test
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def run_paths(engine) -> list[list[int]]:
    """A mixed batch (chunked, preempted), then shared prefixes one by one."""
    outputs = generate(engine, MIXED)
    outputs += [generate(engine, [prompt])[0] for prompt in SHARED]
    return outputs


_single: dict[str, tuple[list[list[int]], list[int]]] = {}


def single_process(model_dirs, name, counts: bool = False):
    """The one-process engine's tokens (and, with `counts`, its per-expert load)."""
    if name not in _single:
        engine = LLMEngine(model_dirs[name], **ENGINE)
        _single[name] = run_paths(engine), engine.metrics().tokens_per_expert
    return _single[name] if counts else _single[name][0]


# -- the split ---------------------------------------------------------------------------


def test_stages_are_contiguous_and_balanced():
    assert [stage_layers(5, r, 2) for r in range(2)] == [range(0, 2), range(2, 5)]
    assert [len(stage_layers(32, r, 3)) for r in range(3)] == [10, 11, 11]
    assert [stage_layers(2, r, 2) for r in range(2)] == [range(0, 1), range(1, 2)]


def test_only_compute_bound_steps_are_cut_into_micro_batches():
    from bitserve.llm.model_runner import MICRO_BATCH_MIN_TOKENS as MIN

    assert micro_batch_count(8, 2) == 1  # a decode step: one pass over the weights
    assert micro_batch_count(2 * MIN - 1, 2) == 1
    assert micro_batch_count(2 * MIN, 2) == 2
    assert micro_batch_count(100 * MIN, 4) == 4


@pytest.fixture
def every_step_micro_batched(monkeypatch):
    """Cut even the tiny test models' steps (rank 0 plans, the workers follow)."""
    monkeypatch.setattr(model_runner, "MICRO_BATCH_MIN_TOKENS", 1)


def test_micro_batches_split_by_sequence_with_even_tokens():
    scheduled = [("a", 100), ("b", 1), ("c", 1), ("d", 1)]
    assert split_micro_batches(scheduled, 1) == [scheduled]
    assert split_micro_batches(scheduled, 2) == [[("a", 100)], [("b", 1), ("c", 1), ("d", 1)]]
    even = [(i, 4) for i in range(6)]
    assert [len(g) for g in split_micro_batches(even, 3)] == [2, 2, 2]
    assert split_micro_batches([("a", 7)], 4) == [[("a", 7)]]
    for n in (2, 3, 4):  # never an empty group, never a sequence lost or reordered
        groups = split_micro_batches(even[:3], n)
        assert all(groups) and [x for g in groups for x in g] == even[:3]


class LoopbackGroup:
    """A control group whose broadcasts go through a queue: root's in, worker's out."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def broadcast(self, tensors, options_or_root):
        if isinstance(tensors, list):  # the root's form: [tensor], BroadcastOptions
            self.queue.put(tensors[0].clone())
        else:  # a worker's form: tensor, root
            tensors.copy_(self.queue.get(timeout=10))
        return types.SimpleNamespace(wait=lambda: None)


def test_step_plans_of_any_size_reach_the_workers():
    """One fixed-size broadcast per step; a plan larger than it takes a second one."""
    from bitserve.llm.parallel import CONTROL_BYTES, Parallel

    channel = Parallel(control=LoopbackGroup())
    plans = [None, [1, 2, 3], list(range(3 * CONTROL_BYTES)), {"x": "y" * (CONTROL_BYTES - 9)}]
    for plan in plans:
        channel.broadcast_object(plan)
        fits = len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)) <= CONTROL_BYTES - 8
        assert channel.control.queue.qsize() == (1 if fits else 2)
        assert channel.receive_object() == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tensor_parallel_size": 3},
            "tensor_parallel_size=3 does not divide num_attention_heads=4",
        ),
        ({"tensor_parallel_size": 4}, "does not divide num_key_value_heads=2"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 is more than"),
        ({"distributed_executor": "slurm"}, "distributed_executor must be"),
        ({"placement_strategy": "ANY"}, "placement_strategy must be"),
    ],
)
def test_a_split_the_model_cannot_take_is_refused_by_name(llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(llama_dir, num_kv_blocks=4, **kwargs)
    with pytest.raises(ValueError, match=message):  # before any worker starts
        LLM(llama_dir, num_kv_blocks=4, **kwargs)


def test_the_default_kv_memory_is_shared_by_the_ranks_of_a_host(llama_dir):
    one = EngineConfig(llama_dir, device="cpu").kv_cache_memory
    four = EngineConfig(llama_dir, device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert four.kv_cache_memory == pytest.approx(one / 4, rel=0.2)  # free memory moves


def test_a_quantized_checkpoint_is_not_split():
    hf = {"num_attention_heads": 4, "quantization_config": {"method": "int8"}}
    with pytest.raises(ValueError, match="quantized checkpoint"):
        EngineConfig(hf_config=hf, num_kv_blocks=4, pipeline_parallel_size=2)
    EngineConfig(hf_config=hf, num_kv_blocks=4)  # one process: fine


def test_gpt2_split_names_its_fields(model_dirs):
    with pytest.raises(ValueError, match="n_head=4"):
        EngineConfig(model_dirs["gpt2"], num_kv_blocks=4, tensor_parallel_size=3)


# -- parity --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_2_matches_one_process(model_dirs, parallel_engine, name):
    engine = parallel_engine(model_dirs[name], tensor_parallel_size=2, **ENGINE)
    attn = engine.runner.attentions[0]
    assert attn.num_heads == 2 and attn.kv_cache[0].shape[0] == attn.num_kv_heads
    outputs = run_paths(engine)
    assert (outputs, engine.metrics().tokens_per_expert) == single_process(model_dirs, name, True)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_parallel_2_matches_one_process(
    model_dirs, parallel_engine, every_step_micro_batched, name
):
    engine = parallel_engine(model_dirs[name], pipeline_parallel_size=2, **ENGINE)
    assert len(engine.runner.attentions) == 1  # stage 0 holds layer 0 and its KV only
    outputs = run_paths(engine)  # the expert counts: both stages' layers, summed on rank 0
    assert (outputs, engine.metrics().tokens_per_expert) == single_process(model_dirs, name, True)


def test_pipeline_sends_prompt_logprobs_back_to_rank0(
    llama_dir, parallel_engine, every_step_micro_batched
):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=2)
    prompts = MIXED[1:4]

    def logprobs(engine):
        llm = LLM.__new__(LLM)
        llm.engine = engine
        return [(o.prompt_logprobs, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    want = logprobs(LLMEngine(llama_dir, num_kv_blocks=64, max_num_batched_tokens=32))
    engine = parallel_engine(
        llama_dir, pipeline_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=32
    )
    got = logprobs(engine)
    for (want_prompt, want_out), (got_prompt, got_out) in zip(want, got, strict=True):
        assert len(got_prompt) == len(want_prompt) and got_prompt[0] is None
        for w, g in zip(want_prompt[1:] + want_out, got_prompt[1:] + got_out, strict=True):
            assert set(g) == set(w)
            assert all(g[t] == pytest.approx(w[t], abs=1e-4) for t in w)


@pytest.mark.parametrize("name", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_tensor_2_by_pipeline_2_matches_one_process(
    model_dirs, parallel_engine, every_step_micro_batched, name
):
    engine = parallel_engine(
        model_dirs[name], tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE
    )
    assert run_paths(engine) == single_process(model_dirs, name)


# -- failures ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seen_by", ["liveness check", "collective"])
def test_a_killed_worker_fails_the_engine_instead_of_hanging(
    llama_dir, parallel_engine, monkeypatch, seen_by
):
    engine = parallel_engine(llama_dir, tensor_parallel_size=2, num_kv_blocks=64)
    generate(engine, MIXED[:1], SamplingParams(temperature=0, max_tokens=2))
    worker = engine.workers.launcher.procs[1]
    if seen_by == "collective":  # as if it died after the check, inside the step
        monkeypatch.setattr(engine.workers.launcher, "dead", lambda: {})
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    started = time.monotonic()
    engine.add_request("r", MIXED[2], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(WorkerDied, match="rank 1" if seen_by != "collective" else "failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 10
    with pytest.raises(WorkerDied):  # the engine stays failed, at once
        engine.step()
    engine.abort_request("r")


@pytest.mark.timeout(120)
def test_a_hung_worker_times_out(llama_dir, parallel_engine):
    engine = parallel_engine(
        llama_dir, tensor_parallel_size=2, num_kv_blocks=64, distributed_timeout_s=3
    )
    worker = engine.workers.launcher.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        engine.add_request("r", MIXED[2], SamplingParams(temperature=0, max_tokens=4))
        started = time.monotonic()
        with pytest.raises(WorkerDied, match="collective"):
            engine.step()
        assert time.monotonic() - started < 15
    finally:
        engine.abort_request("r")
        with contextlib.suppress(ProcessLookupError):  # killed by the engine already
            os.kill(worker.pid, signal.SIGCONT)
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_shutdown_stops_every_worker(llama_dir):
    engine = LLMEngine(llama_dir, pipeline_parallel_size=2, num_kv_blocks=16)
    procs = list(engine.workers.launcher.procs.values())
    engine.shutdown()
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(WorkerDied, match="shut down"):
        engine.add_request("r", MIXED[0], SamplingParams(max_tokens=1))
        engine.step()
    engine.abort_request("r")


def test_one_process_path_has_no_workers(llama_dir):
    engine = LLMEngine(llama_dir, num_kv_blocks=16)
    assert engine.workers is None
    assert engine.runner.parallel.world_size == 1
    assert torch.get_num_threads() == 1


# -- Ray ---------------------------------------------------------------------------------


@pytest.fixture
def ray_cluster():
    """A local Ray of 2 CPUs for this test (or the one this session already runs)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=80 << 20,
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.timeout(300)
def test_ray_workers_in_a_placement_group_match_one_process(
    model_dirs, parallel_engine, ray_cluster
):
    from ray.util import placement_group_table

    from bitserve.llm.workers import RayWorkers

    engine = parallel_engine(
        model_dirs["mixtral"], tensor_parallel_size=2, distributed_executor="ray", **ENGINE
    )
    launcher = engine.workers.launcher
    assert isinstance(launcher, RayWorkers)
    group = launcher.group
    table = placement_group_table(group)
    assert table["strategy"] == "PACK" and table["bundles"] == {0: {"CPU": 1.0}}
    assert run_paths(engine) == single_process(model_dirs, "mixtral")
    ray_cluster.kill(launcher.actors[1])  # a worker lost: the engine fails, loudly
    engine.add_request("r", MIXED[0], SamplingParams(temperature=0, max_tokens=2))
    started = time.monotonic()
    with pytest.raises(WorkerDied, match="failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 30
    engine.abort_request("r")
    assert placement_group_table(group)["state"] == "REMOVED"


# -- the server's engine -------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_the_async_engine_streams_over_workers_and_fails_loudly(llama_dir):
    from bitserve.llm.async_engine import AsyncLLMEngine, EngineDead
    from tests.llm.test_engine import GREEDY, reference

    async def collect(engine, prompt, request_id):
        return [out async for out in engine.generate(prompt, GREEDY, request_id)]

    engine = AsyncLLMEngine(llama_dir, tensor_parallel_size=2, num_kv_blocks=64)
    worker = engine.engine.workers.launcher.procs[1]
    try:
        prompts = MIXED[:3]
        results = await asyncio.gather(
            *(collect(engine, p, f"r{i}") for i, p in enumerate(prompts))
        )
        got = [outputs[-1].outputs[0].token_ids for outputs in results]
        assert got == [reference(llama_dir, p) for p in prompts]
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="rank 1"):
            await asyncio.wait_for(collect(engine, MIXED[0], "after"), timeout=30)
    finally:
        engine.shutdown()
    assert not worker.is_alive()


@pytest.mark.slow  # the engine thread's join waits its 10 s first
@pytest.mark.timeout(120)
async def test_shutdown_with_a_step_stuck_on_a_hung_worker_kills_the_workers(llama_dir):
    from bitserve.llm.async_engine import AsyncLLMEngine, EngineDead

    engine = AsyncLLMEngine(
        llama_dir, tensor_parallel_size=2, num_kv_blocks=64, distributed_timeout_s=60
    )
    worker = engine.engine.workers.launcher.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    params = SamplingParams(temperature=0, max_tokens=4)
    stuck = asyncio.ensure_future(collect_all(engine.generate(MIXED[0], params)))
    await asyncio.sleep(1)
    started = time.monotonic()
    await asyncio.to_thread(engine.shutdown)
    assert time.monotonic() - started < 20  # not the 60 s collective timeout
    worker.join(timeout=10)
    assert not worker.is_alive()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(stuck, timeout=10)


@pytest.mark.timeout(120)
async def test_config_toml_parameters_split_a_served_model(llama_dir):
    """`tensor_parallel_size` in a model's config.toml reaches the engine; a lost
    worker turns the service not-live until the supervisor has rebuilt the engine with new
    workers; a split the model cannot take fails the load."""
    from bitserve.backends.base import LoadError
    from bitserve.backends.llm import LLMService
    from bitserve.config import ModelConfig

    def service(**parameters) -> LLMService:
        config = ModelConfig.model_validate(
            {"name": "m", "backend": "llm", "parameters": {"num_kv_blocks": 32, **parameters}}
        )
        return LLMService(config, llama_dir)

    with pytest.raises(LoadError, match="tensor_parallel_size=3 does not divide"):
        await service(tensor_parallel_size=3).start()
    svc = service(tensor_parallel_size=2)
    await svc.start()  # loads, then a warm-up generation over both ranks
    try:
        assert svc.healthy() is None
        os.kill(svc.engine.engine.workers.launcher.procs[1].pid, signal.SIGKILL)
        with pytest.raises(Exception, match="rank 1"):
            params = SamplingParams(temperature=0, max_tokens=4)
            admitted = svc.process([[5, 6, 7]], [params])[0]
            await asyncio.wait_for(collect_all(svc.generate(admitted)), timeout=30)
        assert "died" in svc.healthy()
        # the supervisor rebuilds the whole engine (new workers) and serves again
        for _ in range(600):
            if svc.restarting is None and svc.engine.dead is None:
                break
            await asyncio.sleep(0.1)
        assert svc.healthy() is None and svc.restarts == 1
        admitted = svc.process([[5, 6, 7]], [params])[0]
        outs = await asyncio.wait_for(collect_all(svc.generate(admitted)), timeout=60)
        assert len(outs[-1].outputs[0].token_ids) == 4
    finally:
        await svc.stop()


async def collect_all(stream):
    return [item async for item in stream]
