"""From logits to next tokens: penalties, temperature, top-k, top-p, min-p, seeded draws.

Greedy rows (temperature 0) are one batched argmax. Sampled rows are processed per
request, because each may carry its own seed (`torch.Generator`) and its own filters.
Logprobs are those of the model's raw distribution (vLLM's default).

No row can take the step down: a row whose logits hold NaN, or whose filtered
distribution is not a distribution (inf, NaN, nothing left), is not sampled; the
sampler answers a `SamplingFailed` for it, and the engine fails that request alone.
The checks ride on reductions the sampler makes anyway (the greedy max, the sum of
the probabilities), so a healthy step pays nothing for them.
"""

from __future__ import annotations

import math

import torch

from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.sequence import Sequence
from bitserve.llm.structured import apply_masks, mask_rows


def apply_penalties(logits: torch.Tensor, seq: Sequence, params: SamplingParams) -> torch.Tensor:
    """Repetition (prompt + output, CTRL-style divide/multiply), presence and frequency
    (output only, OpenAI-style subtraction)."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        output_ids = torch.tensor(seq.output_token_ids, device=logits.device)
        counts = torch.bincount(output_ids, minlength=logits.shape[-1])
        logits -= params.frequency_penalty * counts[: logits.shape[-1]].to(logits.dtype)
        logits -= params.presence_penalty * (counts[: logits.shape[-1]] > 0).to(logits.dtype)
    return logits


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude; the caller renormalises (by sampling)."""
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1) / sorted_probs.sum()
        drop = cumulative - sorted_probs / sorted_probs.sum() >= params.top_p
        drop[..., 0] = False  # the most likely token stays, however small top_p is
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs


def suppress_stops(logits: torch.Tensor, seq: Sequence, eos_token_ids) -> torch.Tensor:
    """Before min_tokens, EOS and stop token ids cannot be drawn."""
    params = seq.sampling_params
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    banned = [t for t in banned if t < logits.shape[-1]]  # admission checked the vocabulary
    if not banned:
        return logits
    logits = logits.clone()
    logits[banned] = float("-inf")
    return logits


def sample_one(logits: torch.Tensor, seq: Sequence, eos_token_ids=()) -> int:
    params = seq.sampling_params
    if seq.num_output_tokens < params.min_tokens and seq.matcher is None:  # the grammar ends it
        logits = suppress_stops(logits, seq, eos_token_ids)
    if params.needs_penalties:
        logits = apply_penalties(logits, seq, params)
    if params.greedy:
        value, token = logits.max(-1)
        if value.isnan():  # max propagates NaN: the row's logits hold one
            raise SamplingFailed(NAN)
        return int(token)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    probs = checked(filter_probs(probs, params))
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def top_logprobs(logprobs: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """The chosen token's logprob plus the n most likely (vLLM's logprobs format)."""
    result = {token_id: float(logprobs[token_id])}
    n = min(n, logprobs.shape[-1])
    if n > 0:
        values, ids = torch.topk(logprobs, n)
        for value, idx in zip(values.tolist(), ids.tolist(), strict=True):
            result.setdefault(idx, value)
    return result


def is_plain_greedy(seq: Sequence) -> bool:
    params = seq.sampling_params
    return (
        params.greedy
        and not params.needs_penalties
        and seq.num_output_tokens >= params.min_tokens
        and seq.matcher is None
    )


def constrain(
    logits: torch.Tensor,
    seqs: list[Sequence],
    rows: list[int],
    masks: tuple[dict[int, int], torch.Tensor] | None,
) -> None:
    """Structured outputs: what each guided row's grammar refuses becomes -inf. `masks`
    ({id(seq): mask row}, bitmask) were computed during the forward pass (engine.step);
    without them (the sampler on its own) they are computed now."""
    if masks is None:
        masks = (
            {id(s): i for i, s in enumerate(seqs)},
            mask_rows([s.matcher for s in seqs], logits.shape[-1]),
        )
    index, bitmask = masks
    apply_masks(logits, rows, bitmask[[index[id(s)] for s in seqs]])


NAN = "the model's logits for this request hold NaN"


class SamplingFailed(RuntimeError):
    """This row's numbers cannot be sampled from; its request fails, the batch goes on."""


def checked(probs: torch.Tensor) -> torch.Tensor:
    """A softmax is never negative: its sum is NaN for NaN logits and 0 when everything
    was masked or filtered away, and either is not a distribution."""
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0:
        raise SamplingFailed(f"the next-token distribution is invalid (sum {total})")
    return probs


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        eos_token_ids=(),
        masks: tuple[dict[int, int], torch.Tensor] | None = None,
    ) -> list[int | SamplingFailed]:
        """One next token per row of `logits` (or why that row failed), and logprobs
        appended to the seqs that ask."""
        tokens: list[int | SamplingFailed] = [0] * len(seqs)
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if guided:
            constrain(logits, [seqs[i] for i in guided], guided, masks)
        simple = [i for i, s in enumerate(seqs) if is_plain_greedy(s)]
        if simple:  # one batched max; it propagates NaN, so it also finds broken rows
            values, picked = logits[simple].max(-1)
            nan = values.isnan().tolist()
            for i, token, bad in zip(simple, picked.tolist(), nan, strict=True):
                tokens[i] = SamplingFailed(NAN) if bad else token
        done = set(simple)
        for i, seq in enumerate(seqs):
            if i not in done:
                try:
                    tokens[i] = sample_one(logits[i], seq, eos_token_ids)
                except SamplingFailed as e:
                    tokens[i] = e
        for i, seq in enumerate(seqs):
            n = seq.sampling_params.logprobs
            if n is not None and not isinstance(tokens[i], SamplingFailed):
                logprobs = torch.log_softmax(logits[i], dim=-1)
                seq.logprobs.append(top_logprobs(logprobs, tokens[i], n))
        return tokens

    @staticmethod
    def prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens first.. from the rows that predicted them."""
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first token has no prediction
        logprobs = torch.log_softmax(logits, dim=-1)
        n = seq.sampling_params.prompt_logprobs
        for i in range(logprobs.shape[0]):
            position = first + i
            if position == len(seq.prompt_logprobs):  # recompute after preemption adds nothing
                token = seq.token_ids[position]
                seq.prompt_logprobs.append(top_logprobs(logprobs[i], token, n))
