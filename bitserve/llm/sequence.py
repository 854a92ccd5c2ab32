"""A request as the engine core sees it: token ids and how far the KV cache has caught up.

vLLM v1's central idea: a request has `num_tokens` (prompt plus generated) and
`num_computed_tokens` (those whose K/V are in the cache). Each step the scheduler
gives it some tokens so the second catches up with the first; prefill, chunked
prefill, decode and recompute after preemption are all the same move.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bitserve.llm.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV dropped; recomputed later
    FINISHED_STOPPED = "stop"  # eos, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed inside a step

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first under the priority policy (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float = 0.0  # when it first left the waiting queue
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table entered in the prefix cache
    # the tokens RoPE scaling treats as computed in one forward (llm/rope.py): the
    # prompt, or the whole sequence once a longrope switch re-prefilled it
    rope_prefix: int = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    order: int = field(default_factory=lambda: next(_arrival_counter))
    device: str = field(default="cpu", repr=False)  # where the seeded generator draws
    matcher: Any = field(default=None, repr=False)  # the structured-output grammar's state
    lora_id: int = 0  # its LoRA adapter's uid (lora.py), 0: the base model
    # speculative decoding (speculative.py): tokens proposed after the last one, scored
    # with it in the next step, and the draft's distribution of each (None: a point mass)
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    spec_probs: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = self.rope_prefix = len(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(
                self.sampling_params.seed
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
