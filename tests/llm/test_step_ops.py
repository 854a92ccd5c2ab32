"""A step without per-row host work, and CUDA graphs for decode, checked on the CPU.

With the C kernels off (`kernels.get` -> None: the code a GPU runs), one decode step
(metadata build, model forward, LM head; the sampler is not counted) must issue the
same aten ops at batch 1 as at batch 32 (nothing per sequence) and read the device
from the host at most once. The CUDA graph logic (capture per bucket at load, pad a
pure decode step to its bucket, replay; eager otherwise) runs here with a stand-in
graph that calls the captured function, on the same static buffers.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the Triton kernels run in Triton's interpreter here (read when triton is imported)
os.environ.setdefault("TRITON_INTERPRET", "1")

from bitserve import kernels
from bitserve.llm import attention, model_runner
from bitserve.llm.model_runner import graph_buckets
from bitserve.llm.sampling_params import SamplingParams
from tests.llm.conftest import build_model, make_engine
from tests.llm.test_architectures import gemma2, qwen3_moe
from tests.llm.test_engine import GREEDY, MIXED, assert_parity, generate, random_prompts

# ops whose result the host must wait for: a scalar read, or an output sized by data
HOST_READS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and len(args) == 1:  # repeats tensor: sized by data
            name = "repeat_interleave(sync)"
        self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> int:
        return sum(n for op, n in self.ops.items() if op in HOST_READS or "(sync)" in op)


def decode_step_ops(engine, batch: int, monkeypatch) -> OpCounter:
    """The ops of one pure decode step of `batch` sequences (prompts of 3..40 tokens)."""
    lengths = [3 + (i * 7) % 38 for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in random_prompts(lengths, seed=batch)]
    engine.step()  # every prompt in one step, then only decodes
    tolist = torch.Tensor.tolist
    counter = OpCounter()

    def counted_tolist(self):  # a host read that bypasses the dispatcher on the CPU
        counter.ops["tolist"] += 1
        return tolist(self)

    scheduled = engine.scheduler.schedule()
    assert all(n == 1 for _, n in scheduled.scheduled) and len(scheduled.scheduled) == batch
    engine.runner.execute(scheduled)  # once uncounted: per-shape caches filled
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with counter:
        out = engine.runner.execute(scheduled)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    counter.ops["tolist"] += 0
    assert out.logits.shape[0] == batch
    for request_id in ids:
        engine.abort_request(request_id)
    return counter


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_a_decode_step_issues_the_same_ops_at_batch_1_and_32(model_dirs, name, monkeypatch):
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(model_dirs[name], device="cpu", num_kv_blocks=128, max_num_seqs=32)
    one = decode_step_ops(engine, 1, monkeypatch)
    many = decode_step_ops(engine, 32, monkeypatch)
    diff = {op: (one.ops[op], many.ops[op]) for op in one.ops | many.ops}
    diff = {op: counts for op, counts in diff.items() if counts[0] != counts[1]}
    assert not diff, f"ops that grow with the batch (batch 1, batch 32): {diff}"
    assert one.host_reads() <= 1 and many.host_reads() <= 1, many.ops


def test_the_torch_path_keeps_parity_with_windows_softcaps_and_moe(tmp_path, monkeypatch):
    """Gemma 2 (sliding windows, soft-capping) and Qwen3-MoE (dense experts) through
    the batched torch attention, chunked prefill included."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    from tests.llm.test_architectures import assert_parity as arch_parity

    for name, make in (("gemma2", gemma2), ("qwen3_moe", qwen3_moe)):
        folder = build_model(tmp_path / name, make())
        engine = make_engine(folder, device="cpu", num_kv_blocks=96, max_num_batched_tokens=16)
        assert engine.runner.kernels is None
        arch_parity(folder, MIXED, generate(engine, MIXED))


class CallGraph:
    """A stand-in for torch.cuda.CUDAGraph: replay calls what was captured, on the same
    static buffers the real graph would read."""

    replays = 0

    def capture(self, fn) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        CallGraph.replays += 1
        self.fn()


def run_staggered(engine, prompts) -> tuple[list[list[int]], list[tuple[bool, int | None]]]:
    """Greedy outputs of requests that stop at different lengths (so the decode batch
    shrinks through several buckets), and per step: (had prompt rows, bucket)."""
    runner, steps = engine.runner, []
    run = runner.run

    def spy(inputs):
        for step in inputs:
            steps.append((len(step.decode[0]) != len(step.input_ids), runner.graph_bucket(step)))
        return run(inputs)

    runner.run = spy
    ids, tokens, late = [], {}, prompts[-1]
    for i, prompt in enumerate(prompts[:-1]):
        params = SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True)
        ids.append(engine.add_request(None, prompt, params))
    for i in itertools.count():
        if i == 3:  # a prompt that arrives while the others decode: a mixed step
            ids.append(engine.add_request(None, late, GREEDY))
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    runner.run = run
    return [tokens[i] for i in ids], steps


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_replayed_decode_steps_give_the_eager_tokens(model_dirs, name, monkeypatch):
    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(model_runner, "graph_factory", lambda config: CallGraph)
    folder = model_dirs[name]
    kwargs = dict(device="cpu", num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=128)
    graphed = make_engine(folder, **kwargs)
    eager = make_engine(folder, enforce_eager=True, **kwargs)
    assert sorted(graphed.runner.graphs) == [1, 2, 4, 8] and not eager.runner.graphs
    CallGraph.replays = 0
    want, eager_steps = run_staggered(eager, MIXED)
    assert CallGraph.replays == 0 and all(bucket is None for _, bucket in eager_steps)
    got, steps = run_staggered(graphed, MIXED)
    assert got == want
    assert CallGraph.replays == sum(bucket is not None for _, bucket in steps) > 0
    # a step with prompt rows runs eagerly; pure decode steps replay, padded to a bucket
    assert sum(mixed for mixed, _ in steps) >= 2
    assert all(bucket is None for mixed, bucket in steps if mixed)
    assert {bucket for mixed, bucket in steps if not mixed} == {1, 2, 4, 8}
    assert graphed.tokens_per_expert() == eager.tokens_per_expert()  # padding not counted


def test_graph_tokens_match_transformers(llama_dir, monkeypatch):
    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(model_runner, "graph_factory", lambda config: CallGraph)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=96, max_num_seqs=8)
    CallGraph.replays = 0
    assert_parity(llama_dir, MIXED, generate(engine, MIXED, GREEDY))
    assert CallGraph.replays > 0


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(1000)[-1] == model_runner.GRAPH_MAX_BATCH


def test_graph_memory_is_counted_inside_the_kv_budget(llama_dir, monkeypatch):
    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(attention, "GATHER_BYTES", 1 << 20)
    budget = 4 << 20
    eager = make_engine(llama_dir, device="cpu", kv_cache_memory=budget, enforce_eager=True)
    monkeypatch.setattr(model_runner, "graph_factory", lambda config: CallGraph)
    graphed = make_engine(llama_dir, device="cpu", kv_cache_memory=budget + (1 << 20))
    runner = graphed.runner
    per_block = runner.bytes_per_block()
    assert runner.graph_reserve() > 0 and eager.runner.graph_reserve() == 0
    assert runner.num_blocks == (budget + (1 << 20) - runner.graph_reserve()) // per_block


def test_the_engine_is_token_exact_through_the_triton_kernels(llama_dir, monkeypatch):
    """The runner's DecodeBatch handed to the Triton kernels (attention and K/V store) as
    a GPU engine does, run here in Triton's interpreter on the CPU tensors."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    from triton.runtime import interpreter

    from bitserve.llm import triton_attention

    patch_tensor = interpreter._patch_lang_tensor

    def patch_numpy24(tensor, scope):  # triton 3.6's interpreter and numpy >= 2.4 (a loop
        patch_tensor(tensor, scope)  # bound int(1-element array)), as test_triton_attention
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_numpy24)
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    engine.runner.paged = triton_attention.paged_attention_triton
    engine.runner.store = triton_attention.write_kv_triton
    calls = Counter()
    for name in ("paged", "store"):
        fn = getattr(engine.runner, name)

        def counted(*args, fn=fn, name=name, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        setattr(engine.runner, name, counted)
    prompts = MIXED[:2]
    assert_parity(llama_dir, prompts, generate(engine, prompts))
    assert calls["paged"] > 0 and calls["store"] == calls["paged"]


class FakeEvent:
    """torch.cuda.Event's two calls the step buffers make."""

    recorded = 0

    def record(self) -> None:
        FakeEvent.recorded += 1

    def synchronize(self) -> None:
        pass


def test_the_device_side_of_the_step_buffer_reads_what_one_upload_copied(llama_dir, monkeypatch):
    """The cuda layout on the CPU: a separate "device" buffer that only the one upload
    per step fills, its pieces viewed at the host's offsets; greedy parity, and the
    pieces a graph reads keep their addresses whatever the number of sampled rows."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    bufs = engine.runner.buffers
    bufs.device_buffer = torch.full_like(bufs.host, 255)  # garbage until uploaded
    bufs._views.clear()
    FakeEvent.recorded = 0
    assert_parity(llama_dir, MIXED, generate(engine, MIXED))
    assert FakeEvent.recorded > 0
    _, one, _ = bufs.views(8, bufs.max_width, 1)
    _, five, _ = bufs.views(8, bufs.max_width, 5)
    assert [t.data_ptr() for t in one[:7]] == [t.data_ptr() for t in five[:7]]
