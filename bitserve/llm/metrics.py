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
    requests_failed_total: int = 0  # requests that failed alone inside a step
    tokens_per_expert: list[int] = field(default_factory=list)
    lora: dict[str, dict[str, int]] = field(default_factory=dict)  # per adapter (lora.py)
    # speculative decoding (speculative.py): proposals, those accepted, tokens the
    # speculative rows emitted (accepted + the target's own), and both by position
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_proposed_per_position: list[int] = field(default_factory=list)
    spec_accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def kv_slots(seqs, block_size: int) -> tuple[int, int]:
    """(allocated, used) token slots over the given sequences. Blocks freed behind a
    sliding window (table entries < 0, a prefix of the table) count in neither."""
    allocated = used = 0
    for s in seqs:
        table = s.block_table
        freed = next((i for i, block in enumerate(table) if block >= 0), len(table))
        allocated += (len(table) - freed) * block_size
        used += s.num_computed_tokens - freed * block_size
    return allocated, used
