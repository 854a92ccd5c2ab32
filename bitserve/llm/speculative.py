"""Speculative decoding: cheap proposals, verified by the target in the step it runs anyway.

A proposer guesses the next k tokens of a decoding request (`Proposer`): `NgramProposer`
looks the last n tokens up in the request's own prompt and output (prompt lookup, no
second model); `DraftProposer` runs a smaller model with the same vocabulary, its own
paged KV cache and block manager, k batched steps. Proposals are made at the start of a
step and kept on the sequence (`spec_token_ids`); the scheduler gives the row 1 + k tokens
in its budget (fewer when the budget or the free blocks are short), and the model runner
computes them as one chunk row of the same forward pass as every other row, sampling
each of the k + 1 positions. `Speculator.verify` then decides, for all speculative rows
of the step at once:

- the target's distribution p at each position is the sampler's own (temperature,
  top-k, top-p, min-p: `Sampler.filtered`; greedy rows a point mass on the argmax;
  grammar masks stepped through the proposals);
- proposal d_j, drawn from the draft's q_j (a point mass for n-gram), is accepted with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn
  from the residual max(p_j - q_j, 0), renormalised; if all k are accepted a bonus token
  is drawn from p_k (Leviathan et al. 2023, Chen et al. 2023). Each emitted token is then
  distributed exactly as the target's, and greedy rows get exactly the target's argmax
  chain: the longest matching prefix plus the target's own next token.

A draft may score only its `draft_vocab` most frequent tokens (FR-Spec: its LM head's
rows for those, the counts from its training corpus; q is then zero elsewhere, which
rejection sampling handles like any q) and stops proposing for a row after a token
whose top draft probability was under `confidence` (SpecDec++'s and transformers'
`assistant_confidence_threshold` idea): both decided by the draft alone, so greedy rows
keep the target's tokens and sampled rows its distribution.

Seeds: the acceptance and residual uniforms of a seeded request come from its seed and
output position (sampler.row_uniform, salted), and so do the draft's: a fixed seed
gives the same text twice. The tokens differ from a non-speculative run's under the
same seed (their distribution does not).

The engine appends the accepted tokens one by one through its ordinary stop checks
(stop strings, stop ids, max_tokens exact) and rolls back the rest: the sequence's
computed tokens stop before its new last token again and the tail blocks that held
only rejected K/V go back to the pool (`Scheduler.rollback`); only a sequence's own
tokens are ever entered in the prefix cache, so it never sees a proposal.

Not speculated (they sample as before): requests that opt out (`speculative=False`),
use repetition/presence/frequency penalties (they change with every token), are still under
min_tokens, or are too close to max_tokens or max_model_len; and every request while
more than `max_batch` run (the step is then compute-bound and k extra rows per request
cost more than they save: bench/speculative.py measures it).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from bitserve.kernels import ptr
from bitserve.llm.block_manager import BlockManager
from bitserve.llm.config import EngineConfig, check_type
from bitserve.llm.model_runner import ModelRunner
from bitserve.llm.sampler import Plan, Sampler, SamplingFailed, row_uniform, to_host, uniform
from bitserve.llm.scheduler import SchedulerOutput
from bitserve.llm.sequence import Sequence, SequenceStatus
from bitserve.llm.structured import apply_masks

METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 16
NGRAM_TOKENS, DRAFT_TOKENS = 6, 5  # num_tokens's defaults
# a draft's default `confidence`. bench/speculative.py --parts tune, tinylm and its int8
# draft, 16 held-out verses (200+, not the demo part's), batch 1, greedy, 5 rounds, CPU-
# time ratio to plain (load 3-6): no stop 1.25x (k 4, 1024-token head); 0.2: 1.33x,
# 0.3: 1.37x, 0.4: 1.30x (k 5, 1024); with a 512-token head 0.25/0.3/0.35: 1.44/1.41/
# 1.42x, k 4/5/6 at 0.3: 1.38/1.41/1.44x. A replay of recorded (top probability, kept)
# pairs under a cost model (a row 8.5% of a plain step, a draft step ~25%) also peaked
# at 0.3 for every k from 3 to 8
DRAFT_CONFIDENCE = 0.3
# above this many running requests nobody speculates. bench/speculative.py --parts
# streams, tinylm, n-gram (1..5-token matches) forced on, the copy-heavy prompts n at
# once, one thread of the 2-core EPYC, 15 rounds, CPU-time ratio to the plain engine
# (min-max): k = 6 at load 11: 1.18 (1.07-1.43) at 2 streams, 1.18 (1.09-1.21) at 3,
# 1.02 (0.86-1.16) at 4, 0.94 at 8; k = 4 at load 4-5: 1.16, 1.13, 0.99, 0.90 at 2, 3,
# 4, 8 streams: past 3 the extra rows cost about what the tokens they save do
MAX_BATCH = 3
SALT_ACCEPT, SALT_RESIDUAL, SALT_DRAFT = 0xACCE, 0x2E51, 0xD2AF


@dataclass
class SpeculativeConfig:
    """`speculative = { method = "ngram" | "draft", model = ..., num_tokens = k }`."""

    method: str
    # k, the most proposals a step: by default 4 for a draft (each one a draft step), 6
    # for n-gram, whose proposals cost nothing to make (bench/speculative.py, copy-heavy
    # prompts, CPU-time ratio to plain: 1.61x at k = 6, 1.51x at 4 over 15 rounds at load
    # 7-11; 1.43x and 1.40x over 5 rounds at load 4-5)
    num_tokens: int | None = None
    model: str | None = None  # the draft's folder: absolute, or next to the target's
    # the suffix lengths the n-gram proposer matches (a match of n proposes at most n + 1
    # tokens). bench/speculative.py, tinylm, k = 4, one thread, 5 rounds, CPU-time ratios
    # to the plain engine (load 5-7): 1..5 gave 1.41x on the copy-heavy prompts, 1.28x
    # on 8 more of them and 1.62x on held-out verses, 2..5 1.40x, 1.25x and 1.55x
    ngram_min: int = 1
    ngram_max: int = 5
    max_batch: int = MAX_BATCH  # more running requests than this: no speculation
    # a draft's LM head restricted to its draft_vocab most frequent tokens (FR-Spec, Zhao
    # et al. 2025; 0: the whole vocabulary), counted on its training corpus
    # (token_counts.json beside it, tools/train_lm.py): the target still scores every
    # token, and a sampled row's q is the draft's distribution over those, so rejection
    # sampling stays exact
    draft_vocab: int = 0
    # a draft stops proposing for a row after a token its own distribution gave less
    # than this (the softmax's top probability of the draft's logits; 0: never): the
    # decision depends on the draft's state only, so outputs stay exact
    confidence: float | None = None  # (drafts: DRAFT_CONFIDENCE; n-gram has none)
    folder: Path | None = field(default=None, repr=False)  # the draft's, resolved

    def __post_init__(self) -> None:
        if self.num_tokens is None:
            self.num_tokens = NGRAM_TOKENS if self.method == "ngram" else DRAFT_TOKENS
        if self.confidence is None:
            self.confidence = 0.0 if self.method == "ngram" else DRAFT_CONFIDENCE

    @classmethod
    def parse(cls, value: Any, target: Path | None) -> SpeculativeConfig:
        """From the model's parameters; ValueError naming `speculative.<field>`."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a table, got {value!r}")
        names = {f.name for f in fields(cls)} - {"folder"}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"speculative: unknown fields {sorted(unknown)}")
        if "method" not in value:
            raise ValueError("speculative.method is required ('ngram' or 'draft')")
        hints = {"method": str, "model": str | None, "confidence": float | None}
        for name, v in value.items():
            check_type(f"speculative.{name}", v, hints.get(name, int))
        config = cls(**value)
        if config.method not in METHODS:
            raise ValueError(
                f"speculative.method must be 'ngram' or 'draft', got {config.method!r}"
            )
        if not 1 <= config.num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"speculative.num_tokens must be in [1, {MAX_NUM_TOKENS}]")
        if not 1 <= config.ngram_min <= config.ngram_max:
            raise ValueError("speculative.ngram_min must be in [1, ngram_max]")
        if config.max_batch < 1:
            raise ValueError("speculative.max_batch must be positive")
        if config.draft_vocab < 0:
            raise ValueError("speculative.draft_vocab must be 0 (all) or positive")
        if not 0 <= config.confidence < 1:
            raise ValueError("speculative.confidence must be in [0, 1)")
        if config.method == "draft":
            if config.model is None:
                raise ValueError("speculative.model (the draft's folder) is required for 'draft'")
            config.folder = draft_folder(config.model, target)
        return config


def draft_folder(name: str, target: Path | None) -> Path:
    """The draft's Hugging Face folder: `name` as given, or beside the target's version
    folder (`models/tinylm/draft` for `models/tinylm/1`), or inside it; a folder of
    numeric versions means its highest."""
    path = Path(name)
    candidates = [path] if path.is_absolute() or target is None else []
    if target is not None and not path.is_absolute():
        candidates += [target.parent / path, target / path, path]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
        versions = sorted(
            (int(p.name), p) for p in folder.glob("*") if p.name.isdigit() and p.is_dir()
        )
        if versions and (versions[-1][1] / "config.json").is_file():
            return versions[-1][1]
    raise ValueError(f"speculative.model: no model folder {name!r} (tried {candidates})")


# -- proposers ----------------------------------------------------------------------------
Proposal = tuple[list[int], torch.Tensor | None]  # tokens, q rows [k, vocab] or None (point mass)


class Proposer(Protocol):
    """What a proposer does: up to k tokens for each (decoding sequence, k)."""

    def propose(self, rows: list[tuple[Sequence, int]]) -> list[Proposal]: ...

    def release(self, seq: Sequence) -> None: ...

    def reset(self) -> None: ...


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (ngram_max down to ngram_min) that
    occurred before in the sequence; its latest earlier occurrence's next tokens, at most
    n + 1 of them (and k): a short match is right less often, and on the CPU every
    proposal costs a verification row whether it is kept or not (tinylm, greedy: a
    one-token match's next tokens were kept 32/18/13/10% of the time, those after a
    match of 5 or more 94/89/85/85%; a row costs ~8% of a plain step).

    Each request keeps an index of its n-grams (n-gram -> the latest position it ends
    at), extended by the tokens appended since the last step (a sequence's tokens are
    only ever appended: rejected proposals never enter it), so a step costs a few dict
    look-ups, not a scan of the whole sequence; `lookup` is the same rule by a scan."""

    def __init__(self, config: SpeculativeConfig):
        self.low, self.high = config.ngram_min, config.ngram_max
        self.reset()

    def propose(self, rows: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [(self.indexed(seq, k), None) for seq, k in rows]

    def indexed(self, seq: Sequence, k: int) -> list[int]:
        """`lookup(seq.token_ids, k)` through the request's n-gram index."""
        entry = self.indexes.get(id(seq))
        if entry is None or entry[0] is not seq:
            entry = self.indexes[id(seq)] = [seq, {}, 0]
        _, index, done = entry
        tokens, low, high = seq.token_ids, self.low, self.high
        last = len(tokens) - 1
        for i in range(done, last):  # the n-grams ending before the last token
            for n in range(low, min(high, i + 1) + 1):
                index[tuple(tokens[i - n + 1 : i + 1])] = i
        entry[2] = max(done, last)
        for n in range(min(high, last), low - 1, -1):
            end = index.get(tuple(tokens[last - n + 1 :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + min(k, n + 1)]
        return []

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:-1] == tokens[last])  # earlier places of the last token
        if not len(ends):
            return []
        length, alive = np.ones(len(ends), dtype=np.int64), np.ones(len(ends), dtype=bool)
        for j in range(1, min(self.high, last)):  # how far back each one matches
            before = ends - j
            alive &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[last - j])
            length += alive
        best = int(length.max())
        if best < self.low:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest
        return tokens[end + 1 : end + 1 + min(k, best + 1)].tolist()

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(id(seq), None)

    def reset(self) -> None:
        self.indexes: dict[int, list] = {}  # id(seq) -> [seq, n-gram -> end, positions done]


class DraftProposer:
    """A smaller model with the target's vocabulary proposes by running k steps. Each
    request has a mirror sequence in the draft's own KV pool; before proposing, the
    mirror keeps the K/V of the longest prefix it shares with the request (what the
    target accepted) and computes the rest, then draws k tokens, one batched step each,
    greedy for greedy requests and from the same filtered distribution otherwise. Those
    steps run in `ModelRunner.decode_steps` (`lean`): one plan for all of them, the step
    buffers moved on in place, the C layers' pointers cast once; a scheduler batch
    through `execute` only where that does not apply (a prompt to catch up on, LoRA,
    tensor parallelism, a sequence-dependent RoPE, flash-attn)."""

    def __init__(self, config: SpeculativeConfig, target: EngineConfig, num_blocks: int):
        self.config = EngineConfig(
            model=config.folder,
            dtype=target.dtype,
            device=target.device,
            block_size=target.block_size,
            num_kv_blocks=num_blocks,
            max_model_len=target.max_model_len,
            max_num_batched_tokens=target.max_num_batched_tokens,
            max_num_seqs=target.max_num_seqs,
            enable_prefix_caching=False,
            enforce_eager=target.enforce_eager,
            seed=target.seed,
        )
        vocab = (self.config.hf_config.get("vocab_size"), target.hf_config.get("vocab_size"))
        if vocab[0] != vocab[1]:
            raise ValueError(
                f"speculative.model: the draft's vocabulary ({vocab[0]}) is not the "
                f"target's ({vocab[1]})"
            )
        self.runner = ModelRunner(self.config)
        a8_from_one_row(self.runner.model)
        if config.draft_vocab:
            restrict_head(self.runner.model, top_tokens(config.folder, config.draft_vocab))
        self.threshold = config.confidence
        self.rng = random.Random(target.seed ^ SALT_DRAFT)
        self.reset()

    def reset(self) -> None:
        self.block_manager = BlockManager(self.config, self.runner.num_blocks)
        self.mirrors: dict[int, Sequence] = {}  # id(target seq) -> mirror
        self.synced: dict[int, int] = {}  # id(target seq) -> its length at the last proposal

    def release(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(id(seq), None)
        self.synced.pop(id(seq), None)
        if mirror is not None:
            self.block_manager.free(mirror)

    def mirror(self, seq: Sequence) -> Sequence:
        """The request's mirror, its tokens now the request's, its K/V kept for their
        common prefix (the tail behind it given back)."""
        m = self.mirrors.get(id(seq))
        if m is None:
            m = Sequence(seq.request_id, list(seq.token_ids), seq.sampling_params)
            m.status = SequenceStatus.RUNNING
            self.mirrors[id(seq)] = m
            return m
        common = min(m.num_computed_tokens, seq.num_tokens)
        mine, theirs = m.token_ids, seq.token_ids
        synced = self.synced.get(id(seq), 0)  # before it, the mirror's tokens are the seq's
        same = next((i for i in range(synced, common) if mine[i] != theirs[i]), common)
        m.token_ids = list(theirs)
        m.num_computed_tokens = same
        self.block_manager.trim(m)
        return m

    @torch.inference_mode()
    def propose(self, rows: list[tuple[Sequence, int]]) -> list[Proposal]:
        drafts: dict[int, tuple[list[int], list[torch.Tensor | None]]] = {}
        active = []
        self.stopped: set[int] = set()  # rows the draft stopped on a doubtful token
        for seq, k in rows:
            m = self.mirror(seq)
            self.synced[id(seq)] = seq.num_tokens
            drafts[id(seq)] = ([], [])
            active.append((seq, m, k))
        while active:
            if self.lean(active, drafts):
                active = [
                    (s, m, k)
                    for s, m, k in active
                    if len(drafts[id(s)][0]) < k and id(s) not in self.stopped
                ]
                continue
            batch, budget, left = SchedulerOutput(), self.config.max_num_batched_tokens, []
            for seq, m, k in active:
                n = min(m.num_tokens - m.num_computed_tokens, budget)
                if n <= 0:
                    left.append((seq, m, k))
                elif self.block_manager.allocate_slots(m, n):
                    batch.scheduled.append((m, n))
                    budget -= n
                    left.append((seq, m, k))
                else:  # the draft's pool is full: this request proposes nothing now
                    self.release(seq)
                    drafts[id(seq)] = ([], [])
            if not batch:
                break
            out = self.runner.execute(batch)
            for m, n in batch.scheduled:
                m.num_computed_tokens += n
            by_mirror = {id(m): seq for seq, m, _ in left}
            targets = [by_mirror[id(m)] for m in out.sample_seqs]
            if targets:
                positions = [
                    m.num_tokens - s.num_prompt_tokens
                    for s, m in zip(targets, out.sample_seqs, strict=True)
                ]
                tokens, probs = self.draw(out.logits, targets, positions)
                sure = self.confident(out.logits)
                for i, (seq, m, token, q) in enumerate(
                    zip(targets, out.sample_seqs, tokens, probs, strict=True)
                ):
                    m.token_ids.append(token)
                    drafts[id(seq)][0].append(token)
                    drafts[id(seq)][1].append(q)
                    if sure is not None and not sure[i]:
                        self.stopped.add(id(seq))
            active = [
                (s, m, k)
                for s, m, k in left
                if len(drafts[id(s)][0]) < k and id(s) not in self.stopped
            ]
        proposals = []
        for seq, _ in rows:
            tokens, qs = drafts[id(seq)]
            sampled = bool(qs) and qs[0] is not None
            proposals.append((tokens, torch.stack(qs) if sampled else None))
        return proposals

    def lean(self, active: list[tuple[Sequence, Sequence, int]], drafts: dict) -> bool:
        """The draft's steps in `ModelRunner.decode_steps` (one plan for all of them, the
        buffers moved on in place) when every row has one token left to compute, or two
        for greedy rows (the target kept all proposals: the last one and its own token,
        fed in one step after the other, the first step's pick being the known token):
        as many steps as the row with the fewest still to go needs. False (nothing
        done): the generic loop's step runs instead."""
        if not self.runner.can_decode_steps:
            return False
        ahead = [m.num_tokens - m.num_computed_tokens - 1 for _, m, _ in active]
        targets = [seq for seq, _, _ in active]
        greedy = all(seq.sampling_params.greedy for seq in targets)
        if any(a not in (0, 1) for a in ahead) or (any(ahead) and not greedy):
            return False
        steps = min(
            a + k - len(drafts[id(seq)][0]) for a, (seq, _, k) in zip(ahead, active, strict=True)
        )
        mirrors = [m for _, m, _ in active]
        if not all(self.block_manager.allocate_slots(m, steps) for m in mirrors):
            return False
        qs: list[list[torch.Tensor | None]] = []
        # the step after which each row proposes no more (its token doubtful), else None
        last: list[int | None] = [None] * len(active)

        def stop(logits: torch.Tensor, s: int) -> bool:
            """Whether every row has stopped, after step s (its token in `last`)."""
            sure = self.confident(logits)
            if sure is None:
                return False
            for i, ok in enumerate(sure):
                if not ok and last[i] is None and s >= ahead[i]:
                    last[i] = s
            return all(x is not None for x in last)

        head = getattr(self.runner.model, "draft_head", None) if greedy else None
        if greedy and self.runner.on_cpu:  # numpy on the logits' memory: ~1 us an op
            known = [i for i, a in enumerate(ahead) if a]  # step 0 feeds their next token
            values = np.array([mirrors[i].token_ids[-1] for i in known], dtype=np.int64)
            ids = head.host_ids if head is not None else None

            def pick(logits: torch.Tensor, s: int) -> np.ndarray:
                tokens = logits.numpy().argmax(-1)
                if ids is not None:
                    tokens = ids[tokens]
                if s == 0 and known:
                    tokens[known] = values
                return tokens

            def stop(logits: torch.Tensor, s: int) -> bool:
                """Whether every row has stopped, after step s (its token in `last`)."""
                x = logits.numpy()
                # the top probability: 1 / sum(exp(x - max))
                total = np.exp(x - x.max(-1, keepdims=True)).sum(-1)
                for i, t in enumerate(total.tolist()):
                    if t * self.threshold > 1.0 and last[i] is None and s >= ahead[i]:
                        last[i] = s
                return all(x is not None for x in last)

        elif greedy:
            known = [i for i, a in enumerate(ahead) if a]
            device = self.runner.device
            rows = torch.tensor(known, dtype=torch.int64, device=device)
            values = torch.tensor([mirrors[i].token_ids[-1] for i in known], device=device)
            ids = head.ids.to(device) if head is not None else None

            def pick(logits: torch.Tensor, s: int) -> torch.Tensor:
                tokens = logits.argmax(-1)
                if ids is not None:
                    tokens = ids[tokens]
                return tokens.index_copy_(0, rows, values) if s == 0 and known else tokens
        else:
            base = [
                m.num_tokens - s.num_prompt_tokens for s, m in zip(targets, mirrors, strict=True)
            ]

            def pick(logits: torch.Tensor, s: int) -> torch.Tensor:
                tokens, probs = self.draw(logits, targets, [b + s for b in base])
                qs.append(probs)
                return torch.tensor(tokens, device=logits.device)

        until = stop if self.threshold else None
        logits = head.logits if head is not None else None
        tokens = self.runner.decode_steps(mirrors, steps, pick, until, logits)
        drawn = to_host(tokens.t())  # [n][ran]
        ran = len(drawn[0])
        for i, (seq, m, tokens) in enumerate(zip(targets, mirrors, drawn, strict=True)):
            tokens = tokens[ahead[i] :]
            m.token_ids += tokens  # all it computed: the next mirror() keeps what it needs
            m.num_computed_tokens += ran
            if last[i] is not None:  # proposals up to the doubtful token, then no more
                self.stopped.add(id(seq))
                tokens = tokens[: last[i] + 1 - ahead[i]]
            drafts[id(seq)][0].extend(tokens)
            drafts[id(seq)][1].extend([q[i] for q in qs[: len(tokens)]] or [None] * len(tokens))
        return True

    def confident(self, logits: torch.Tensor) -> list[bool] | None:
        """Per row, whether the draft's top probability reaches `confidence` (None: no
        threshold). The draft's own logits only: a sampled row's stop does not depend on
        the target, so rejection sampling stays exact."""
        if not self.threshold:
            return None
        top = torch.softmax(logits.float(), -1).amax(-1)
        return [bool(x) for x in to_host(top >= self.threshold)]

    def draw(
        self, logits: torch.Tensor, targets: list[Sequence], positions: list[int]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One token per row: the argmax for greedy requests, else a draw from the
        target's sampling settings applied to the draft's logits (q, kept); `positions`:
        each row's output position (its seed's uniform)."""
        if all(seq.sampling_params.greedy for seq in targets):
            return [int(t) for t in to_host(logits.argmax(-1))], [None] * len(targets)
        probs = target_probs(logits, targets, random.Random(0))
        u = []
        for seq, position in zip(targets, positions, strict=True):
            seed = seq.sampling_params.seed
            u.append(
                uniform(self.rng.getrandbits(64))
                if seed is None
                else row_uniform(seed ^ SALT_DRAFT, position)
            )
        drawn = inverse_cdf(probs, torch.tensor(u, dtype=torch.float64, device=probs.device))
        tokens = [int(t) for t in to_host(drawn)]
        return tokens, [
            None if seq.sampling_params.greedy else probs[i] for i, seq in enumerate(targets)
        ]


def top_tokens(folder: Path, n: int) -> torch.Tensor:
    """The ids of the `n` most frequent tokens of the draft's training corpus (ascending),
    from the token_counts.json that tools/train_lm.py writes beside its version folders
    (or in the version folder)."""
    for path in (folder / "token_counts.json", folder.parent / "token_counts.json"):
        if path.is_file():
            counts = torch.tensor(json.loads(path.read_text())["counts"], dtype=torch.float64)
            break
    else:
        raise ValueError(
            f"speculative.draft_vocab: no token_counts.json in {folder} or beside it "
            "(tools/train_lm.py writes it)"
        )
    if n > len(counts):
        raise ValueError(f"speculative.draft_vocab: {n} is more than the {len(counts)} tokens")
    # most frequent first, ties by id; a stable sort keeps it the same on every load
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


def a8_from_one_row(model: torch.nn.Module) -> None:
    """A draft's int8 layers with int8 activations round x to int8 from one row on (the
    VNNI GEMM), not from 5 as a served int8 model does to keep its perplexity: a draft's
    roundings only change what it proposes, which the target checks."""
    from bitserve.llm.quant.linear import Int8Linear

    for module in model.modules():
        if type(module) is Int8Linear and module.int8_activations:
            module.a8_from = 1
            if module.prepared_for == module.device:
                module.prepare()


def restrict_head(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The draft's LM head scores only `ids` (FR-Spec): a head of those rows, its logits
    spread back to the full vocabulary with -inf elsewhere (so every sampler step and
    the target's verification see ordinary full-vocabulary rows, q zero outside)."""
    from bitserve.llm.models.layers import Linear
    from bitserve.llm.quant.linear import Int8Linear

    head = model.lm_head
    if type(head) is Linear:
        rows = head.unpacked() if head.packed else head.weight
        sub = Linear(rows.shape[1], len(ids), bias=False)
        sub.weight = torch.nn.Parameter(rows.detach()[ids].contiguous(), requires_grad=False)
        sub.kernels = head.kernels
        if sub.kernels is not None:
            sub.pack()
    elif type(head) is Int8Linear:
        sub = Int8Linear(head.in_features, len(ids), False, head.int8_activations)
        sub.qweight, sub.scales = head.qweight[ids].contiguous(), head.scales[ids].contiguous()
    else:
        raise ValueError(f"speculative.draft_vocab: the draft's {type(head).__name__} head")
    if head.bias is not None or getattr(model, "final_softcap", None) is not None:
        raise ValueError("speculative.draft_vocab: a head with a bias or a soft-cap")
    vocab = head.weight.shape[0] if type(head) is Linear else head.out_features
    model.lm_head = sub
    full = torch.full((1, vocab), float("-inf"))
    index = ids.to(torch.int64)

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = sub(hidden).float()
        return full.expand(len(logits), -1).index_copy(1, index, logits)

    model.compute_logits = compute_logits
    model.draft_head = DraftHead(sub, index)


class DraftHead:
    """A restricted head's own logits, [n, len(ids)] fp32, for the draft loop's greedy
    steps (their argmax and top probability are those of the full-vocabulary logits,
    -inf elsewhere; `ids` maps the argmax back): an int8 head's C GEMV (the call its
    forward makes) with the pointers cast once for the loop's hidden-state buffer and
    an output buffer reused from step to step, else the head's forward."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor):
        from bitserve.llm.quant.linear import SMALL_M

        self.head, self.ids = head, ids
        self.host_ids = ids.numpy() if ids.device.type == "cpu" else None
        # the rows up to which Int8Linear.matmul takes the C kernel (every row count with
        # int8 activations: bs_gemv then rounds x to int8 from the weight's a8_rows on)
        self.c_rows = 1 << 30 if getattr(head, "int8_activations", False) else SMALL_M
        self.cached: tuple | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head, n = self.head, len(hidden)
        w = getattr(head, "c_weight", None)
        if w is None or hidden.dtype is not torch.float32 or hidden.stride(1) != 1:
            return head(hidden).float()
        key = (hidden.data_ptr(), n, hidden.stride(0), id(w))
        if self.cached is None or self.cached[0] != key:
            if n > self.c_rows:
                return head(hidden).float()
            out = torch.empty(n, w.N)
            args = (w, ptr(hidden), hidden.stride(0), n, ptr(out))
            self.cached = (key, args, out, hidden)  # (the pointers' tensors kept alive)
        _, args, out, _ = self.cached
        head.c_kernels.lib.bs_gemv(*args)
        return out


# -- verification ---------------------------------------------------------------------------
def target_probs(logits: torch.Tensor, seqs: list[Sequence], rng: random.Random) -> torch.Tensor:
    """Each row's distribution as the sampler draws it, normalised: a point mass on the
    argmax for greedy rows; NaN rows stay NaN (the caller fails them)."""
    plan = Plan(seqs, logits.shape[-1], (), rng)
    probs = torch.zeros_like(logits)
    probs.scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if plan.special:
        d = plan.send(logits.device)
        rows = d["special"].long()
        kept = Sampler.filtered(logits.index_select(0, rows), plan, d)
        probs.index_copy_(0, rows, kept / kept.sum(-1, keepdim=True))
    return probs.masked_fill(logits[:, :1].isnan(), float("nan"))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's draw: the first token whose cumulative mass reaches u x the total."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    return (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp_max(probs.shape[-1] - 1)


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probability of keeping a proposal drawn from q: min(1, p/q)."""
    return (p / q.clamp_min(1e-30)).clamp_max(1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(p - q, 0), renormalised by the draw."""
    return (p - q).clamp_min(0.0)


@dataclass
class SpecStats:
    """The Prometheus counters: proposals made, accepted, tokens emitted by speculative
    rows (accepted + the target's own, cut by stops), acceptance by position."""

    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0  # speculative rows verified
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, k: int, a: int) -> None:
        self.steps += 1
        self.proposed += k
        self.accepted += a
        grow = k - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(k):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < a


class Speculator:
    """The engine's side of speculative decoding: propose before a step, verify after."""

    def __init__(self, config: SpeculativeConfig, engine: EngineConfig, num_blocks: int):
        self.config = config
        self.max_model_len = engine.max_model_len
        self.proposer: Proposer
        if config.method == "ngram":
            self.proposer = NgramProposer(config)
        else:
            self.proposer = DraftProposer(config, engine, num_blocks)
        self.rng = random.Random(engine.seed ^ SALT_ACCEPT)
        k = config.num_tokens  # every position's counters from the start (0 until used)
        self.stats = SpecStats(proposed_at=[0] * k, accepted_at=[0] * k)

    def reset(self) -> None:
        self.proposer.reset()

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def num_tokens(self, seq: Sequence) -> int:
        """How many proposals this row may have now (0: it decodes as before)."""
        p = seq.sampling_params
        if (
            not p.speculative
            or p.needs_penalties
            or seq.num_output_tokens < p.min_tokens
            or seq.status != SequenceStatus.RUNNING
            or seq.num_tokens - seq.num_computed_tokens != 1
        ):
            return 0
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.config.num_tokens, room - 1))

    def propose(self, running: list[Sequence]) -> None:
        """Proposals for the running decodes, kept on each sequence for the next step."""
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        if len(running) > self.config.max_batch:
            return
        rows = [(seq, k) for seq in running if (k := self.num_tokens(seq)) > 0]
        if not rows:
            return
        for (seq, _), (tokens, probs) in zip(rows, self.proposer.propose(rows), strict=True):
            if seq.matcher is not None and tokens:  # the grammar's prefix of them
                tokens = tokens[: seq.matcher.validate_tokens(tokens)]
            seq.spec_token_ids = tokens
            seq.spec_probs = probs[: len(tokens)] if probs is not None and tokens else None

    @torch.inference_mode()
    def verify(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[list[int] | SamplingFailed]:
        """The tokens each speculative row emits. `logits` holds 1 + k rows per
        sequence (k = its proposals still scheduled), in the order of `seqs`. Greedy
        rows need the argmax only; sampled rows go through rejection sampling."""
        counts = [1 + len(seq.spec_token_ids) for seq in seqs]
        self.mask(logits, seqs, counts)
        values, argmax = logits.max(-1)  # max propagates NaN: it finds broken rows too
        argmax = argmax.masked_fill_(values.isnan(), -1)  # -1: a NaN row
        sampled = [i for i, seq in enumerate(seqs) if not seq.sampling_params.greedy]
        if sampled:
            parts = [argmax.double(), *self.rejection(logits, seqs, counts, sampled)]
            host = to_host(torch.cat(parts))
        else:  # greedy rows only: their argmax, read as ints
            host = to_host(argmax)
        out = self.decide(seqs, counts, set(sampled), host)
        self.logprobs(logits, seqs, counts, out)
        return out

    @staticmethod
    def logprobs(logits: torch.Tensor, seqs: list[Sequence], counts: list[int], out) -> None:
        """The emitted tokens' logprobs (and top n) for the rows that ask, as the sampler
        gives them: the raw distribution after the grammar mask. The engine drops those
        of tokens a stop cut off."""
        wanted = [
            i
            for i, seq in enumerate(seqs)
            if seq.sampling_params.logprobs is not None and isinstance(out[i], list)
        ]
        if not wanted:
            return
        starts = np.cumsum([0, *counts])
        rows = [int(starts[i]) + j for i in wanted for j in range(len(out[i]))]
        tokens = [t for i in wanted for t in out[i]]
        device = logits.device
        lp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=device)), -1)
        chosen = lp.gather(1, torch.tensor(tokens, device=device)[:, None])
        n = min(max(seqs[i].sampling_params.logprobs for i in wanted), logits.shape[-1])
        parts = [chosen.flatten().double()]
        if n:
            top = lp.topk(n, dim=-1)
            parts += [top.values.flatten().double(), top.indices.flatten().double()]
        host = to_host(torch.cat(parts))
        m = len(rows)
        values, ids = host[m : m + m * n], host[m + m * n :]
        r = 0
        for i in wanted:
            keep = min(seqs[i].sampling_params.logprobs, n)
            for token in out[i]:
                entry = {token: host[r]}
                for w in range(keep):
                    entry.setdefault(int(ids[r * n + w]), values[r * n + w])
                seqs[i].logprobs.append(entry)
                r += 1

    def rejection(
        self, logits: torch.Tensor, seqs: list[Sequence], counts: list[int], sampled: list[int]
    ) -> list[torch.Tensor]:
        """For the rows of the sampled sequences: whether each proposal is kept, the token
        drawn from the residual (the bonus row: from p itself), whether p is valid."""
        starts = np.cumsum([0, *counts])
        index = [r for i in sampled for r in range(starts[i], starts[i + 1])]
        device = logits.device
        x = logits.index_select(0, torch.tensor(index, device=device))
        rows = [seqs[i] for i in sampled for _ in range(counts[i])]
        p = target_probs(x, rows, self.rng)
        q = torch.zeros_like(p)
        drafted, u_accept, u_residual, at = [], [], [], 0
        for i in sampled:
            seq, c = seqs[i], counts[i]
            tokens = seq.spec_token_ids
            if seq.spec_probs is not None:
                q[at : at + c - 1] = seq.spec_probs[: c - 1].to(q)
            else:
                q[torch.arange(at, at + c - 1), tokens] = 1.0
            drafted += [*tokens, 0]
            seed, base = seq.sampling_params.seed, seq.num_output_tokens
            for j in range(c):
                if seed is None:
                    u_accept.append(uniform(self.rng.getrandbits(64)))
                    u_residual.append(uniform(self.rng.getrandbits(64)))
                else:
                    u_accept.append(row_uniform(seed ^ SALT_ACCEPT, base + j))
                    u_residual.append(row_uniform(seed ^ SALT_RESIDUAL, base + j))
            at += c
        picked = torch.tensor(drafted, device=device)[:, None]
        keep = acceptance(p.gather(1, picked), q.gather(1, picked))[:, 0]
        keep = torch.tensor(u_accept, dtype=torch.float64, device=device) < keep.double()
        left = residual(p, q)
        left = torch.where(left.sum(-1, keepdim=True) > 0, left, p)
        drawn = inverse_cdf(left, torch.tensor(u_residual, dtype=torch.float64, device=device))
        return [keep.double(), drawn.double(), torch.isfinite(p).all(-1).double()]

    def decide(self, seqs, counts, sampled: set[int], host) -> list[list[int] | SamplingFailed]:
        """Per sequence: the proposals kept, then the target's token (plain Python)."""
        total = sum(counts)
        argmax = host[:total]  # -1: a NaN row
        rs = (len(host) - total) // 3
        keep, drawn, valid = (host[total + j * rs : total + (j + 1) * rs] for j in range(3))
        out: list[list[int] | SamplingFailed] = []
        at = sub = 0
        for i, (seq, c) in enumerate(zip(seqs, counts, strict=True)):
            tokens = seq.spec_token_ids
            a = 0
            if i in sampled:
                bad = not all(valid[sub : sub + c])
                while a < c - 1 and keep[sub + a]:
                    a += 1
                last = drawn[sub + a]
                sub += c
            else:
                bad = -1 in argmax[at : at + c]
                while a < c - 1 and tokens[a] == argmax[at + a]:
                    a += 1
                last = argmax[at + a]
            at += c
            if bad:
                out.append(SamplingFailed("the model's logits for this request hold NaN"))
                continue
            self.stats.record(c - 1, a)
            out.append([*tokens[:a], int(last)])
        return out

    @staticmethod
    def mask(logits: torch.Tensor, seqs: list[Sequence], counts: list[int]) -> None:
        """Grammar masks of every position of the guided rows: the matcher stepped
        through the proposals (which it accepted when they were made) and back."""
        guided = [(i, seq) for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not guided:
            return
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        starts = np.cumsum([0, *counts])
        rows = [int(starts[i]) + j for i, seq in guided for j in range(counts[i])]
        bitmask = allocate_token_bitmask(len(rows), logits.shape[-1])
        r = 0
        for _, seq in guided:
            for token in [*seq.spec_token_ids, None]:
                fill_next_token_bitmask(seq.matcher, bitmask, r)
                r += 1
                if token is not None:
                    seq.matcher.consume_token(token)
            if seq.spec_token_ids:
                seq.matcher.rollback(len(seq.spec_token_ids))
        apply_masks(logits, rows, bitmask)
