"""The prefix-cache-aware router on its own: its block hashes are the engine block
manager's, it follows the longest cached prefix unless that replica is past the bound,
and says which rule decided."""

from __future__ import annotations

import pytest

from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.sequence import Sequence
from bitserve.repository.llmreplicas import PrefixRouter

BS = 4


def test_hashes_are_the_block_managers_and_skip_the_last_token():
    bm = BlockManager(EngineConfig(block_size=BS, num_kv_blocks=16), 16)
    ids = list(range(100, 113))  # 13 tokens: 3 full blocks, the 13th always recomputed
    seq = Sequence("r", ids, SamplingParams(max_tokens=4))
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    bm.free(seq)  # its full blocks stay cached under their hashes
    cached = set(bm.hash_to_block)
    router = PrefixRouter(BS)
    assert router.hashes(ids) == bm.block_hashes(seq, 3)
    assert set(router.hashes(ids)) <= cached
    assert len(router.hashes(ids[:12])) == 2  # 12 tokens: the 12th is recomputed


def test_longest_prefix_wins_unless_overloaded():
    router = PrefixRouter(BS, imbalance=2)
    a, b = "a", "b"
    router.add(a, 64)
    router.add(b, 64)
    system_1, system_2 = list(range(16)), list(range(50, 66))
    first = router.pick([*system_1, 1, 2], [a, b])  # nothing cached: least-loaded
    router.load[first] += 1
    other = router.pick([*system_2, 3], [a, b])  # least-loaded: the other one
    assert other is not first
    router.load[other] += 1
    assert router.pick([*system_1, 7, 8, 9], [a, b]) is first
    assert router.pick([*system_2, 4, 5], [a, b]) is other
    # a longer shared prefix beats a shorter one
    router.load[first] += 2  # 3 in flight vs 1: still within the bound
    assert router.pick([*system_1, 9], [a, b]) is first
    router.load[first] += 1  # 4 vs 1: past it, the least-loaded takes it
    assert router.pick([*system_1, 9], [a, b]) is other
    assert router.decisions == {
        "prefix": 3,
        "least_loaded": 2,
        "overloaded": 1,
        "sticky": 0,
        "round_robin": 0,
    }
    # an unhealthy replica is not a candidate, whatever it holds
    assert router.pick([*system_1, 9], [other]) is other


def test_map_is_bounded_by_the_replica_kv_pool():
    router = PrefixRouter(BS)
    router.add("a", 4)
    router.pick(list(range(40)), ["a"])
    assert len(router.holds["a"]) == 4  # the most recent blocks of the chain stay


def test_sticky_sessions_and_round_robin():
    router = PrefixRouter(BS, imbalance=1)
    for r in ("a", "b"):
        router.add(r, 64)
    home = router.pick([1, 2, 3], ["a", "b"], key="alice")
    assert router.pick(list(range(30)), ["a", "b"], key="alice") is home
    assert router.decisions["sticky"] == 1
    router.load[home] += 2  # past the bound: the session moves
    moved = router.pick([1], ["a", "b"], key="alice")
    assert moved is not home
    router.remove(moved)
    assert "alice" not in router.sticky
    rr = PrefixRouter(BS, policy="round_robin")
    for r in ("a", "b"):
        rr.add(r, 64)
    picks = [rr.pick([1, 2, 3, 4, 5], ["a", "b"]) for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]


def test_autoscaling_config_names_what_it_cannot_scale():
    from bitserve.config import ModelConfig

    group = {"isolation": "ray", "autoscaling": {"max_replicas": 2}}
    doc = {"name": "m", "backend": "python", "max_batch_size": 4, "instance_group": group}
    assert ModelConfig.model_validate(doc).instance_group.autoscaling.max_replicas == 2
    with pytest.raises(ValueError, match=r"autoscaling: .* not a diffusion model"):
        ModelConfig.model_validate({**doc, "backend": "diffusion"})
    with pytest.raises(ValueError, match="only with isolation"):
        ModelConfig.model_validate({**doc, "instance_group": {**group, "isolation": "thread"}})
