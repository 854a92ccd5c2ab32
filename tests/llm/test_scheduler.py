"""The scheduler with fake requests: budgets, chunking, preemption order, policies."""

from __future__ import annotations

import pytest

from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.scheduler import RequestTooLong, Scheduler
from bitserve.llm.sequence import Sequence, SequenceStatus


def scheduler(num_blocks=16, **kwargs) -> Scheduler:
    kwargs = {"block_size": 4, "max_model_len": 64, **kwargs}
    config = EngineConfig(num_kv_blocks=num_blocks, **kwargs)
    return Scheduler(config, BlockManager(config, num_blocks))


def request(name, n, max_tokens=8, priority=0) -> Sequence:
    base = 1000 * (1 + sum(map(ord, name)))  # distinct tokens: no prefix-cache hits
    return Sequence(
        name, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), priority=priority
    )


def run_step(s: Scheduler):
    """Schedule, then pretend the model ran: advance computed tokens, sample token 7."""
    out = s.schedule()
    s.update_from_output(out)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(7)
    return {seq.request_id: n for seq, n in out.scheduled}, [p.request_id for p in out.preempted]


def drain(s: Scheduler) -> None:
    for seq in list(s.running) + list(s.waiting):
        s.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_decodes_and_prefill_chunks_share_one_token_budget():
    s = scheduler(max_num_batched_tokens=10)
    s.add(request("a", 6))
    s.add(request("b", 12))
    assert run_step(s) == ({"a": 6, "b": 4}, [])  # b's prompt is chunked
    assert run_step(s) == ({"a": 1, "b": 8}, [])  # a decodes, b finishes its prompt
    assert run_step(s) == ({"a": 1, "b": 1}, [])
    drain(s)


def test_max_num_seqs_limits_admission():
    s = scheduler(max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 3))
    assert run_step(s)[0] == {"a": 3, "b": 3}
    assert len(s.waiting) == 1
    drain(s)


def test_preemption_takes_the_newest_request_first_and_recomputes_it():
    s = scheduler(num_blocks=6)
    s.add(request("a", 8))  # 2 blocks
    s.add(request("b", 8))
    s.add(request("c", 8))
    assert run_step(s)[0] == {"a": 8, "b": 8, "c": 8}  # 6 blocks, pool full
    scheduled, preempted = run_step(s)  # a needs a third block: c (newest) goes
    assert preempted == ["c"]
    assert scheduled == {"a": 1, "b": 1}
    c = s.waiting.peek()
    assert c.request_id == "c" and c.num_computed_tokens == 0 and c.block_table == []
    assert c.status == SequenceStatus.PREEMPTED and s.num_preemptions == 1
    drain(s)


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = scheduler(num_blocks=4)
    s.add(request("a", 8))
    s.add(request("b", 8))
    run_step(s)
    _, preempted = run_step(s)  # a needs a block -> b preempted, then a fits
    assert preempted == ["b"]
    drain(s)


def test_priority_policy_admits_and_preempts_by_priority():
    s = scheduler(num_blocks=4, scheduling_policy="priority", max_num_seqs=1)
    s.add(request("low", 4, priority=5))
    s.add(request("high", 4, priority=0))
    assert run_step(s)[0] == {"high": 4}
    drain(s)
    s = scheduler(num_blocks=4, scheduling_policy="priority")
    s.add(request("urgent", 8, priority=0))
    s.add(request("background", 8, priority=9))
    run_step(s)
    s.running.reverse()  # whatever the order, the victim is the lowest priority
    assert run_step(s)[1] == ["background"]
    drain(s)


def test_fcfs_waiting_queue_keeps_arrival_order_and_preempted_go_first():
    s = scheduler(num_blocks=4, max_num_seqs=1)
    for name in "abc":
        s.add(request(name, 4))
    assert list(run_step(s)[0]) == ["a"]
    s.preempt(s.running.pop())
    assert [q.request_id for q in s.waiting] == ["a", "b", "c"]
    drain(s)


def test_admission_rejects_what_can_never_fit():
    s = scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(RequestTooLong, match="max_model_len"):
        s.add(request("a", 60, max_tokens=8))
    with pytest.raises(RequestTooLong, match="KV blocks"):
        s.add(request("b", 16, max_tokens=8))  # 24 tokens = 6 blocks > 4
    assert not s.has_unfinished()


def test_a_request_that_fits_alone_always_finishes():
    s = scheduler(num_blocks=5)
    for name in "abcd":
        s.add(request(name, 6, max_tokens=14))  # 2 blocks to start, all 5 at the end
    for _ in range(200):
        run_step(s)
        for seq in list(s.running):
            if seq.num_output_tokens >= 14:
                s.finish(seq, SequenceStatus.FINISHED_LENGTH)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 5
