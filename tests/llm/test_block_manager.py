"""Block pool, block tables, ref counts and prefix caching, driven by fake requests."""

from __future__ import annotations

from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.sequence import Sequence

BS = 4


def manager(num_blocks=8, caching=True) -> BlockManager:
    config = EngineConfig(block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=caching)
    return BlockManager(config, num_blocks)


def seq(tokens, name="r") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """As the scheduler admits a request (it, not the block manager, writes its state)."""
    hits = bm.get_computed_blocks(s)
    assert bm.allocate_slots(s, s.num_tokens - len(hits) * BS, hits)
    s.num_cached_tokens = len(hits) * BS
    s.num_computed_tokens = s.num_tokens
    return hits


def test_allocation_takes_blocks_in_order_and_free_returns_them():
    bm = manager()
    a = seq(range(10))
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_decode_allocates_a_block_only_when_the_last_one_is_full():
    bm = manager()
    a = seq(range(7))
    admit(bm, a)
    assert a.block_table == [0, 1]
    a.append_token(99)  # token 8 fits in block 1
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1]
    a.num_computed_tokens += 1
    a.append_token(98)  # token 9 needs block 2
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2]
    bm.free(a)


def test_shared_prefix_hits_full_blocks_and_counts_references():
    bm = manager()
    a, b = seq(range(10), "a"), seq([*range(8), 50, 51, 52], "b")
    admit(bm, a)
    hits = admit(bm, b)
    assert hits == [0, 1]  # two full blocks of 4 shared; block 2 differs
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_the_last_prompt_token_is_always_recomputed():
    bm = manager()
    a = seq(range(8), "a")
    admit(bm, a)
    bm.free(a)
    b = seq(range(8), "b")  # identical prompt: only the first block may hit
    assert admit(bm, b) == [0]
    bm.free(b)


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = manager(num_blocks=4)
    a = seq(range(12), "a")
    admit(bm, a)
    bm.free(a)
    # the free queue holds the tail of `a` first: its longest prefix is evicted first
    assert list(bm.free_queue) == [3, 2, 1, 0]
    c = seq(range(100, 104), "c")  # one new block: evicts block 3 (unhashed), then 2
    admit(bm, c)
    assert c.block_table == [3]
    d = seq(range(200, 204), "d")
    admit(bm, d)
    assert d.block_table == [2]  # a's third block (tokens 8..11) evicted
    b = seq(range(12), "b")
    assert bm.get_computed_blocks(b) == [0, 1]  # still cached
    for s in (c, d):
        bm.free(s)


def test_a_hit_on_a_free_block_takes_it_back_out_of_the_free_queue():
    bm = manager(num_blocks=4)
    a = seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    b = seq([*range(8), 7, 7, 7, 7, 7], "b")  # needs 4 blocks: 2 hits + 2 new
    hits = admit(bm, b)
    assert hits == [0, 1]
    assert bm.num_free_blocks == 0
    assert sorted(b.block_table) == [0, 1, 2, 3]
    bm.free(b)


def test_allocation_fails_cleanly_when_the_pool_is_short():
    bm = manager(num_blocks=3)
    a = seq(range(10), "a")
    admit(bm, a)
    b = seq(range(50, 55), "b")
    assert not bm.allocate_slots(b, 5)
    assert b.block_table == [] and bm.num_free_blocks == 0
    bm.free(a)


def test_no_hits_when_prefix_caching_is_off():
    bm = manager(caching=False)
    a, b = seq(range(10), "a"), seq(range(10), "b")
    admit(bm, a)
    assert admit(bm, b) == []
    assert bm.prefix_cache_hits == 0 and not bm.hash_to_block
    bm.free(a)
    bm.free(b)


def test_requests_asking_for_prompt_logprobs_skip_the_cache():
    bm = manager()
    a = seq(range(10), "a")
    admit(bm, a)
    b = Sequence("b", list(range(10)), SamplingParams(prompt_logprobs=1))
    assert bm.get_computed_blocks(b) == []
    bm.free(a)
