"""A snapshot of the engine's state for the server's /metrics (vLLM's names and meanings).

KV waste = slots in blocks held by requests minus tokens stored in them: with paging
only a request's last block is partly empty, so it stays under a block per request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineMetrics:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_num_blocks: int = 0
    kv_block_size: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    kv_slots_allocated: int = 0
    kv_slots_used: int = 0
    kv_waste: float = 0.0  # (allocated - used) / allocated slots of running requests
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which served from the cache
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    tokens_per_expert: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def kv_slots(seqs, block_size: int) -> tuple[int, int]:
    """(allocated, used) token slots over the given sequences."""
    allocated = sum(len(s.block_table) for s in seqs) * block_size
    used = sum(s.num_computed_tokens for s in seqs)
    return allocated, used
