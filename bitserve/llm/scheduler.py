"""Continuous batching, vLLM v1 style: one token budget per step, no prefill/decode phases.

Each step the scheduler walks the running requests, then the waiting ones, and gives
each `min(num_tokens - num_computed_tokens, budget left)` tokens. A decode gets one
token; a long prompt gets a chunk (chunked prefill) and decodes share the step with it.
When the block pool runs dry, the newest running request (lowest priority under the
priority policy) is preempted: its blocks are freed and it will be recomputed. A
request whose longrope scaling switches to the long factors (it grew past the original
length, `rope.py`) is recomputed the same way, at once, as transformers' `generate` does.

The scheduler is the one owner of a request's state: its status (WAITING, RUNNING,
PREEMPTED, finished) and how many of its tokens are computed. The block manager only
hands out blocks; the engine only appends the tokens it samples.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from bitserve.inference import InvalidRequest
from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig
from bitserve.llm.rope import RopeRegime
from bitserve.llm.sequence import Sequence, SequenceStatus


class RequestTooLong(InvalidRequest):
    """The request can never fit (prompt + max_tokens past the context, or the KV pool):
    refused at admission instead of waiting forever. The one "too long" error (400)."""


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class WaitingQueue:
    """FCFS: a deque (preempted requests go back to the front). Priority: a heap on
    (priority, arrival order)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.items: deque[Sequence] | list[tuple[int, int, Sequence]] = (
            deque() if policy == "fcfs" else []
        )

    def add(self, seq: Sequence, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self.items, (seq.priority, seq.order, seq))
        elif front:
            self.items.appendleft(seq)
        else:
            self.items.append(seq)

    def peek(self) -> Sequence:
        return self.items[0] if self.policy == "fcfs" else self.items[0][2]

    def pop(self) -> Sequence:
        return self.items.popleft() if self.policy == "fcfs" else heapq.heappop(self.items)[2]

    def remove(self, seq: Sequence) -> None:
        if self.policy == "fcfs":
            self.items.remove(seq)
        else:
            self.items = [item for item in self.items if item[2] is not seq]
            heapq.heapify(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items) if self.policy == "fcfs" else (item[2] for item in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.rope = RopeRegime(config.hf_config)

    # -- admission --------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        self.check_length(seq.num_prompt_tokens, seq.sampling_params.max_tokens)

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """The one "too long" check: every protocol's front door (backends/llm.py) and
        the engine's own admission call it. Read-only, so safe on any thread."""
        total = prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.config.max_model_len} tokens; "
                f"the request has {prompt_tokens} prompt tokens and max_tokens {max_tokens} "
                f"({total} in all), which exceeds max_model_len"
            )
        # under a sliding window the blocks behind it are freed: the window bounds it
        num_blocks = self.block_manager.blocks_needed(total, self.config.max_num_batched_tokens)
        if num_blocks > self.block_manager.num_blocks:
            raise RequestTooLong(
                f"the request needs {num_blocks} KV blocks ({total} tokens) but the pool "
                f"has only {self.block_manager.num_blocks}: raise kv_cache_memory"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.scheduling_policy == "priority":  # the victim is always the tail
            self.running.sort(key=lambda s: (s.priority, s.order))
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.rope.switches(seq.rope_prefix, seq.num_tokens):
                self.restart(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.spec_token_ids:  # a decode row scores its proposals too, in budget
                num_new = self._speculate(seq, num_new, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self._pick_victim()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if self.rope.switches(seq.rope_prefix, seq.num_tokens):  # preempted before
                self.restart(seq)
            if not self.lora_fits(seq):
                break
            hits = self.block_manager.get_computed_blocks(seq)
            num_computed = len(hits) * self.config.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.block_manager.allocate_slots(seq, num_new, hits):
                break
            self.waiting.pop()
            if hits:  # the prefix cache's tokens are computed already
                seq.num_computed_tokens = seq.num_cached_tokens = num_computed
            seq.first_scheduled_time = seq.first_scheduled_time or time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def lora_fits(self, seq: Sequence) -> bool:
        """Every adapter of a step needs a slot (lora.py): a request with one starts only
        while the running requests use it already or fewer than max_loras adapters."""
        if not seq.lora_id:
            return True
        used = {s.lora_id for s in self.running} - {0}
        return seq.lora_id in used or len(used) < self.config.max_loras

    def _speculate(self, seq: Sequence, num_new: int, budget: int) -> int:
        """A decode row's tokens with its proposals (speculative.py): as many as the
        budget and the free blocks take; none when it is not a decode (a recompute)."""
        spec = seq.spec_token_ids
        if num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            spec.clear()
            return num_new
        del spec[budget - 1 :]
        while spec and not self.block_manager.can_append(seq, 1 + len(spec)):
            spec.pop()  # short of blocks: fewer proposals before anyone is preempted
        return 1 + len(spec)

    def rollback(self, seq: Sequence) -> None:
        """After a speculative step: the KV of the rejected proposals is not the
        sequence's; its computed tokens stop before its last token again."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.block_manager.trim(seq)

    def _pick_victim(self) -> Sequence:
        """The tail of `running`: the newest admitted (fcfs) or lowest priority (priority);
        never a request already scheduled in this step, which all sit before it."""
        return self.running.pop()

    def restart(self, seq: Sequence) -> None:
        """Longrope's switch: the KV computed with the short factors is dropped and the
        whole sequence is computed again, as one forward over its tokens would rotate it
        (rope_prefix), with the long factors; its prefix-cache keys change with it."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.rope_prefix = seq.num_tokens
        seq.block_hashes = []

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV, go back to waiting, start over later."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(seq, front=True)

    # -- after the model ran --------------------------------------------------------------
    def update_from_output(self, batch: SchedulerOutput) -> None:
        """The step ran: each scheduled request's KV now covers its new tokens (vLLM v1's
        update_from_output; the engine then appends sampled tokens and checks stops)."""
        for seq, num_new in batch.scheduled:
            seq.num_computed_tokens += num_new

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a request (finished or aborted) and free its blocks now."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)
