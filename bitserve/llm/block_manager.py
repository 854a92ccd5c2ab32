"""PagedAttention's memory manager: fixed-size KV blocks, block tables, prefix caching.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots. A sequence
owns a block table (the ids of its blocks, in order), so its KV is non-contiguous and
only its last block can hold unused slots — the waste PagedAttention bounds.

Automatic prefix caching (vLLM v1, `block_pool.py`): every full block gets a chained
hash `hash((parent_hash, tokens))`, so equal prefixes map to equal hashes. A freed
block keeps its hash and goes to the tail of an LRU free queue; a later request with
the same prefix takes it back ("touch") instead of recomputing it. Allocation evicts
from the head. The queue is an OrderedDict: append, remove and pop are O(1).

Sliding windows (`config.kv_window`, set when every layer slides): a query at position
q reads keys after q - window only, so before each allocation the blocks that lie
wholly before the window of the next token to compute go back to the pool. Their
entries in the block table become FREED (-1): positions still index the table, and
the model runner never reads them. A long generation then holds about
window / block_size + 1 blocks, whatever its length.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from bitserve.llm.config import EngineConfig, kv_window
from bitserve.llm.rope import RopeRegime
from bitserve.llm.sequence import Sequence, SequenceStatus

NO_PARENT = 0x5EED  # the parent hash of a sequence's first block
FREED = -1  # a block-table entry whose block was freed behind a sliding window


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default=(), repr=False)  # checked on a hit: no collisions
    rope: tuple | None = None  # the rotation its keys were computed with (rope.py), checked too


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_hash(parent: int, token_ids: tuple[int, ...], rope: tuple | None = None) -> int:
    return hash((parent, token_ids, rope))


class BlockManager:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.window = kv_window(config.hf_config)  # None: some layer sees everything
        self.rope = RopeRegime(config.hf_config)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` ever holds at once, computing at
        most `chunk` tokens a step: all of them, or under a sliding window those its
        window spans plus the step's chunk (admission: Scheduler.check_fits)."""
        full = cdiv(num_tokens, self.block_size)
        if self.window is None:
            return full
        return min(full, cdiv(self.window - 1 + chunk, self.block_size) + 1)

    # -- prefix caching -------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of `seq`'s first full blocks, computed once and kept on the seq.
        Under a sequence-dependent RoPE scaling (rope.py) each also holds the rotation of
        its keys, so a block computed with other frequencies is never reused."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else NO_PARENT
            if not hashes and seq.lora_id:  # another adapter's K/V differ: its own chain
                parent = hash((NO_PARENT, seq.lora_id))
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(chain_hash(parent, tokens, self.rope_key(seq, i)))
        return hashes[:num_full_blocks]

    def rope_key(self, seq: Sequence, i: int) -> tuple | None:
        return self.rope.block_key(seq.rope_prefix, i * self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest cached prefix of a new request, in block ids (references not taken).

        The last prompt token is always recomputed: its logits are needed to sample.
        Requests that want prompt logprobs skip the cache (cached tokens have no logits).
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, h in enumerate(self.block_hashes(seq, num_full)):
            block_id = self.hash_to_block.get(h)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = None if block_id is None else self.blocks[block_id]
            if block is None or block.token_ids != tokens or block.rope != self.rope_key(seq, i):
                break
            hits.append(block_id)
        if seq.status != SequenceStatus.PREEMPTED:  # a recompute is not a new query
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Enter the blocks that `num_tokens` computed tokens fill into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        hashes = self.block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.rope = self.rope_key(seq, i)
                self.hash_to_block[block.hash] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()
    ) -> bool:
        """Give `seq` the blocks it needs for `num_new_tokens` more tokens; False if short.

        `computed_blocks` (a prefix-cache hit, only on a request's first allocation) are
        taken with their K/V; the scheduler then moves the request's computed tokens
        past them (it alone writes a request's state).
        """
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        if self.window is not None and not computed_blocks:
            self.free_outside_window(seq)
        num_required = cdiv(num_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(seq.block_table) - len(computed_blocks)
        evictable_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - evictable_hits:
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
            seq.block_table.append(block_id)
        if computed_blocks:
            seq.num_registered_blocks = len(computed_blocks)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._pop_free_block())
        # speculative tokens (past seq.num_tokens) are not the sequence's yet: never cached
        self._register_full_blocks(seq, min(num_tokens + num_new_tokens, seq.num_tokens))
        return True

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(seq, num_new_tokens)` finds enough free blocks (a
        running sequence; under a sliding window it may free some first)."""
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return needed - len(seq.block_table) <= self.num_free_blocks

    def trim(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: give back the tail blocks that hold only
        rejected tokens (past num_computed_tokens). They were never entered in the prefix
        cache (only a sequence's own tokens are), so they go to the free queue's head."""
        keep = max(cdiv(seq.num_computed_tokens, self.block_size), seq.num_registered_blocks)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            if block_id != FREED:
                self._release(block_id)

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks. Tail blocks go first into the LRU queue, so the
        longest prefixes are evicted first; blocks with no hash go to the head."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def free_outside_window(self, seq: Sequence) -> int:
        """Free the blocks no query from the next token on can see; returns how many.
        The next query is at num_computed_tokens and sees keys from q - window + 1.
        Walks back from the last such block to the first one freed before: O(freed)."""
        first_visible = seq.num_computed_tokens - self.window + 1
        i = min(max(first_visible, 0) // self.block_size, len(seq.block_table)) - 1
        count = 0
        while i >= 0 and seq.block_table[i] != FREED:
            self._release(seq.block_table[i])
            seq.block_table[i] = FREED
            count += 1
            i -= 1
        return count

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.hash is None:
                self.free_queue.move_to_end(block_id, last=False)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.rope = None, (), None
        block.ref_count = 1
        return block_id

    # -- metrics ------------------------------------------------------------------------
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.hash is not None:
                self.hash_to_block.pop(block.hash, None)
                block.hash, block.token_ids, block.rope = None, (), None
