"""From logits to next tokens, the whole batch at once: grammar masks, min_tokens,
penalties, temperature, top-k, top-p, min-p, seeded and unseeded draws, logprobs.

No work per row on the device and one device-to-host read a step (`to_host`): the
rows' settings are gathered on the host in one pass and sent in one copy (`Plan`),
every operation then runs over the batch, and what the host needs (tokens, validity,
logprobs) comes back packed in one tensor.

- Plain greedy rows (temperature 0, no penalties, past min_tokens) are one max of the
  logits (grammar masks are applied in place before it). The other rows are gathered
  once ([R, vocab]); min_tokens bans and penalties are (row, token) pairs built on the
  host, applied by one gather and one index_put: their cost follows the tokens a row
  has seen, not R x vocab.
- Each filter becomes a per-row probability threshold: top-k the k-th largest, top-p
  the smallest of the nucleus (one sort of the rows that ask for top-p, after top-k),
  min-p `min_p` times the largest; one `where` keeps what passes all three. Ties at a
  threshold are kept (the per-row sort-and-cut kept an arbitrary one of them).
- The draw is inverse-CDF sampling with one uniform u per row: the first token whose
  cumulative probability (a float64 cumsum of the kept probabilities) reaches u times
  their sum. Filtered tokens (p = 0) never win, nothing is renormalised, and the row's
  sum is the validity check as well. Greedy rows with penalties take the argmax.

Seeds. A torch.Generator per request cannot be batched (one draw per seeded row, one
launch each). The uniforms are computed on the host instead, one per row:
u = splitmix64(seed, output position) as 53 bits + 1/2 over 2**53, in (0, 1), sent
with the other numbers. So a seeded request's tokens depend on its seed, its position
and its own logits only: the same whatever else is in the batch and after a
preemption, and its u is the same on the CPU and a GPU (a torch.Generator's CPU and
CUDA streams differ). Unseeded rows draw u from the sampler's own `random.Random`,
seeded from torch's seed (the engine's `seed`): one code path for any mix of rows.
Changing this scheme changes which tokens a seed gives (not their distribution).

Logprobs are those of the model's raw distribution (vLLM's default), after the grammar
mask. No row can take the step down: a row whose logits hold NaN, or whose filtered
distribution is not one (inf, NaN, nothing left), is not sampled; the sampler answers
a `SamplingFailed` for it, and the engine fails that request alone. The checks ride on
reductions the sampler makes anyway (the max, the sum of the kept probabilities).
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from bitserve.llm.sequence import Sequence
from bitserve.llm.structured import apply_masks, mask_rows

NAN = "the model's logits for this request hold NaN"
MASK64 = (1 << 64) - 1


class SamplingFailed(RuntimeError):
    """This row's numbers cannot be sampled from; its request fails, the batch goes on."""


def to_host(packed: torch.Tensor) -> list[float]:
    """The step's one device-to-host read (tests count the calls)."""
    return packed.tolist()


# -- the uniforms -----------------------------------------------------------------------
def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(bits: int) -> float:
    """53 random bits as a float in (0, 1), never 0 (u = 0 would pick a p = 0 token 0)."""
    return ((bits >> 11) + 0.5) / 2**53


def row_uniform(seed: int, position: int) -> float:
    """A seeded row's uniform at output position `position`."""
    return uniform(splitmix64(splitmix64(seed & MASK64) ^ position))


# -- one step's plan ---------------------------------------------------------------------
PARTS = (
    *("special", "sampled", "temperature", "top_k", "top_p", "min_p", "uniform", "nucleus"),
    *("ban_rows", "ban_cols", "repetition", "frequency", "presence"),
    *("pair_rows", "pair_cols", "counts", "lp_rows"),
)


def upload(values: list[float], device: torch.device) -> torch.Tensor:
    """Host numbers to `device` in one copy, without waiting for the device (pinned on
    cuda); float64 holds every token id and uniform exactly."""
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Plan:
    """One step's per-row numbers, gathered on the host in one pass over the rows and
    sent to the device in one copy (`send`)."""

    def __init__(self, seqs: list[Sequence], vocab: int, eos_token_ids, rng: random.Random):
        self.size = len(seqs)
        self._parts: dict[str, list[float]] = {name: [] for name in PARTS}
        self.special = self._parts["special"]  # the rows that are not plain greedy
        self.logprobs: list[tuple[int, int]] = []  # (row, n)
        self.top_k_max, self.any_min_p, self.any_sampled, self.any_greedy = 0, False, False, False
        for i, seq in enumerate(seqs):
            self.add(i, seq, vocab, eos_token_ids, rng)

    def add(self, i: int, seq: Sequence, vocab: int, eos_token_ids, rng: random.Random) -> None:
        p, part = seq.sampling_params, self._parts
        if p.logprobs is not None:
            self.logprobs.append((i, p.logprobs))
            part["lp_rows"].append(i)
        suppress = seq.num_output_tokens < p.min_tokens and seq.matcher is None  # grammar ends
        if p.greedy and not p.needs_penalties and not suppress:
            return
        j = len(self.special)
        self.special.append(i)
        if suppress:  # before min_tokens, EOS and stop token ids cannot be drawn
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            banned = [t for t in banned if t < vocab]  # admission checked the vocabulary
            part["ban_rows"] += [j] * len(banned)
            part["ban_cols"] += banned
        part["repetition"].append(p.repetition_penalty)
        part["frequency"].append(p.frequency_penalty)
        part["presence"].append(p.presence_penalty)
        if p.needs_penalties:  # repetition: prompt + output; presence/frequency: output
            counts = Counter(seq.output_token_ids)
            seen = set(seq.token_ids) if p.repetition_penalty != 1.0 else set(counts)
            seen = [t for t in seen if t < vocab]
            part["pair_rows"] += [j] * len(seen)
            part["pair_cols"] += seen
            part["counts"] += [counts.get(t, 0) for t in seen]
        part["sampled"].append(not p.greedy)
        self.any_sampled |= not p.greedy
        part["temperature"].append(p.temperature or 1.0)
        top_k = p.top_k if 0 < p.top_k < vocab and not p.greedy else 0
        part["top_k"].append(top_k)
        self.top_k_max = max(self.top_k_max, top_k)
        part["top_p"].append(p.top_p)
        if p.top_p < 1.0 and not p.greedy:
            part["nucleus"].append(j)
        part["min_p"].append(p.min_p)
        self.any_min_p |= p.min_p > 0.0 and not p.greedy
        self.any_greedy |= p.greedy
        if p.greedy:
            part["uniform"].append(0.5)
        elif p.seed is None:
            part["uniform"].append(uniform(rng.getrandbits(64)))
        else:
            part["uniform"].append(row_uniform(p.seed, seq.num_output_tokens))

    def send(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The parts as device tensors: views of one copy."""
        sent = upload([v for values in self._parts.values() for v in values], device)
        out, start = {}, 0
        for name, values in self._parts.items():
            out[name] = sent.narrow(0, start, len(values))
            start += len(values)
        return out


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
    apply_masks(logits, rows, bitmask, [index[id(s)] for s in seqs])


# -- the sampler -------------------------------------------------------------------------
class Sampler:
    def __init__(self) -> None:
        self.rng = random.Random(torch.initial_seed())  # the unseeded rows' uniforms

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        eos_token_ids=(),
        masks: tuple[dict[int, int], torch.Tensor] | None = None,
    ) -> list[int | SamplingFailed]:
        """One next token per row of `logits` (or why that row failed), and logprobs
        appended to the seqs that ask. All device work happens before the one read."""
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if guided:
            constrain(logits, [seqs[i] for i in guided], guided, masks)
        vocab = logits.shape[-1]
        plan = Plan(seqs, vocab, eos_token_ids, self.rng)
        # all plain greedy rows without logprobs (a batch-1 greedy decode): nothing to send
        d = plan.send(logits.device) if plan.special or plan.logprobs else {}
        values, tokens = logits.max(-1)  # max propagates NaN: it finds broken rows too
        parts = [tokens, values.isnan()]
        if plan.special:
            rows = d["special"].long()
            special, invalid, total = self.special_rows(logits.index_select(0, rows), plan, d)
            tokens = tokens.index_copy(0, rows, special)
            parts = [tokens, parts[1], invalid, total]
        if plan.logprobs:
            lp_rows = d["lp_rows"].long()
            logprobs = torch.log_softmax(logits.index_select(0, lp_rows), dim=-1)
            parts.append(logprobs.gather(1, tokens.index_select(0, lp_rows)[:, None]))
            n = min(max(n for _, n in plan.logprobs), vocab)
            if n > 0:
                parts += list(logprobs.topk(n, dim=-1))
        host = to_host(torch.cat([p.flatten().double() for p in parts]))
        return self.unpack(host, seqs, plan)

    @staticmethod
    def special_rows(
        x: torch.Tensor, plan: Plan, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens of the rows that are not plain greedy ([R, vocab] logits, a copy), with
        each row's 'not a distribution' flag and the sum of its kept probabilities."""
        if d["ban_rows"].numel():  # shapes are known on the host: no read
            cells = (d["ban_rows"].long(), d["ban_cols"].long())
            x.index_put_(cells, x.new_full((), float("-inf")))
        if d["pair_rows"].numel():
            rows = d["pair_rows"].long()
            cells = (rows, d["pair_cols"].long())
            v, counts = x[cells], d["counts"].float()
            r = d["repetition"].float()[rows]
            v = torch.where(v > 0, v / r, v * r)  # CTRL-style: toward zero either way
            v = v - d["frequency"].float()[rows] * counts
            v = v - d["presence"].float()[rows] * (counts > 0).float()
            x.index_put_(cells, v)
        greedy = x.argmax(-1) if plan.any_greedy else None
        if not plan.any_sampled:
            no = torch.zeros_like(greedy, dtype=torch.bool)
            return greedy, no, torch.ones_like(x[:, 0])
        probs = Sampler.filtered(x, plan, d)
        cdf = probs.cumsum(-1, dtype=torch.float64)
        total = cdf[:, -1]
        drawn = (cdf < (d["uniform"] * total)[:, None]).sum(-1)  # the first reaching u x sum
        sampled = d["sampled"].bool()
        invalid = sampled & ~(torch.isfinite(total) & (total > 0))
        if greedy is not None:
            drawn = torch.where(sampled, drawn, greedy)
        return drawn, invalid, total

    @staticmethod
    def filtered(x: torch.Tensor, plan: Plan, d: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows' probabilities after temperature, top-k, top-p and min-p, not
        renormalised (what a draw samples from; speculative.py verifies against it)."""
        probs = torch.softmax(x / d["temperature"].float()[:, None], dim=-1)
        threshold = torch.zeros_like(probs[:, 0])
        if plan.top_k_max:
            k = d["top_k"].long()
            kth = probs.topk(plan.top_k_max, dim=-1).values.gather(1, (k - 1).clamp_min(0)[:, None])
            threshold = torch.where(k > 0, kth[:, 0], threshold)
        if d["nucleus"].numel():
            rows = d["nucleus"].long()
            floor = threshold.index_select(0, rows)
            kept = probs.index_select(0, rows)
            kept = torch.where(kept >= floor[:, None], kept, 0.0).sort(-1, descending=True)[0]
            total = kept.sum(-1, keepdim=True)
            before = kept.cumsum(-1) / total - kept / total  # the mass of the tokens above
            top_p = d["top_p"].float().index_select(0, rows)
            n = (before < top_p[:, None]).sum(-1).clamp_min(1)  # the first token stays
            cut = kept.gather(1, (n - 1)[:, None])[:, 0]
            threshold = threshold.index_copy(0, rows, torch.maximum(floor, cut))
        if plan.any_min_p:
            threshold = torch.maximum(threshold, d["min_p"].float() * probs.amax(-1))
        if plan.top_k_max or d["nucleus"].numel() or plan.any_min_p:
            probs = torch.where(probs >= threshold[:, None], probs, 0.0)
        return probs

    @staticmethod
    def unpack(host: list[float], seqs: list[Sequence], plan: Plan) -> list[int | SamplingFailed]:
        """The packed read as tokens, failures and logprobs (plain Python: cannot fail)."""
        b, r = plan.size, len(plan.special)
        tokens: list[int | SamplingFailed] = [int(t) for t in host[:b]]
        for i, nan in enumerate(host[b : 2 * b]):
            if nan:
                tokens[i] = SamplingFailed(NAN)
        at = 2 * b
        if r:
            invalid, total = host[at : at + r], host[at + r : at + 2 * r]
            for j, i in enumerate(plan.special):
                if invalid[j] and not isinstance(tokens[i], SamplingFailed):
                    message = f"the next-token distribution is invalid (sum {total[j]})"
                    tokens[i] = SamplingFailed(message)
            at += 2 * r
        if plan.logprobs:
            m = len(plan.logprobs)
            chosen = host[at : at + m]
            width = (len(host) - at - m) // (2 * m)
            values = host[at + m : at + m + m * width]
            ids = host[at + m + m * width :]
            for k, (i, n) in enumerate(plan.logprobs):
                if isinstance(tokens[i], SamplingFailed):
                    continue
                entry = {tokens[i]: chosen[k]}
                for w in range(min(n, width)):
                    entry.setdefault(int(ids[k * width + w]), values[k * width + w])
                seqs[i].logprobs.append(entry)
        return tokens

    @staticmethod
    @torch.inference_mode()
    def prompt_logprobs(seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens first.. from the rows that predicted them (one read)."""
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first token has no prediction
        start = len(seq.prompt_logprobs) - first  # recompute after preemption adds nothing
        if not 0 <= start < logits.shape[0]:
            return
        logprobs = torch.log_softmax(logits[start:], dim=-1)
        targets = seq.token_ids[first + start : first + logits.shape[0]]
        index = upload(targets, logits.device).long()[:, None]
        n = min(seq.sampling_params.prompt_logprobs, logits.shape[-1])
        parts = [logprobs.gather(1, index)] + (list(logprobs.topk(n, dim=-1)) if n else [])
        host = to_host(torch.cat([p.flatten().double() for p in parts]))
        m = len(targets)
        for k, token in enumerate(targets):
            entry = {token: host[k]}
            for w in range(n):
                entry.setdefault(int(host[m + m * n + k * n + w]), host[m + k * n + w])
            seq.prompt_logprobs.append(entry)
