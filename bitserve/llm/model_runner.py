"""Turns a scheduler decision into one forward pass over a flattened, padding-free batch.

All scheduled tokens of all requests are concatenated into one row each
(`input_ids`, `positions`); `slot_mapping` says where each token's K/V goes in the
block pool, and each request's block table says where its context lives. Only the
rows that need a next token (the last row of a request whose prompt is done) go
through the LM head, plus prompt rows when prompt logprobs were asked for.

Everything lives on `config.device`: weights, the KV pool, RoPE tables and the
per-step index tensors (built on the host, then copied over once per step). The C
kernels and the huge-page pool are CPU-only; on cuda the pool is a plain
`torch.zeros` in the model's dtype and attention takes the torch/flash-attn paths.

Tensor/pipeline parallelism (parallel.py, workers.py): rank 0 (this process) turns
the scheduler's decision into `StepInput`s, plain lists that it broadcasts to the
worker ranks; every rank builds the same tensors and runs `run()`, its share of the
forward. With pipeline stages a compute-bound step (a big prefill) is cut into
micro-batches by sequence, so stage 0 starts micro-batch 2 while stage 1 runs
micro-batch 1; the last stage sends the logits back to rank 0, which samples.
Micro-batches live within one step: the scheduler and the engine loop are the same
as with one process, and tokens are identical by construction. The price is a bubble
at each step's start and end; keeping several steps in flight (vLLM's virtual
engines) would remove it, but needs a scheduler that skips sequences in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from bitserve import kernels
from bitserve.llm.attention import (
    AttentionMetadata,
    DecodeBatch,
    GatherWorkspace,
    SeqSlice,
    flash_attn,
)
from bitserve.llm.config import EngineConfig
from bitserve.llm.models import load_model
from bitserve.llm.parallel import SINGLE, Parallel
from bitserve.llm.rope import RopeRegime
from bitserve.llm.scheduler import SchedulerOutput
from bitserve.llm.sequence import Sequence

KV_DTYPE_CPU = torch.float32  # bf16 SDPA on CPU is several times slower than fp32


@dataclass
class ModelOutput:
    sample_seqs: list[Sequence] = field(default_factory=list)  # those that get a new token
    logits: torch.Tensor | None = None  # [len(sample_seqs), vocab], fp32
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # request_id -> (first position predicted, logits rows [n, vocab])


@dataclass
class StepInput:
    """One (micro-)batch's forward inputs as plain lists: planned once on rank 0, sent
    as is to the worker ranks, made into tensors on each rank's device by `build`."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seqs: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    # (start, end, context_len, block table): the sequences attended one by one
    decode: tuple[list[list[int]], list[int], list[int]] | None = None
    # with the C kernels, every row in order: (each sequence's block table padded with 0,
    # its context_len after the step, its number of rows); a row attends keys 0 .. its
    # position
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[str, int, list[int]]] = field(default_factory=list)
    # (request_id, first position predicted, rows) for prompt logprobs
    rope_prefix: list[int] = field(default_factory=list)  # each row's seq.rope_prefix, or
    # none when the model's RoPE does not depend on the sequence (rope.py)


MICRO_BATCH_MIN_TOKENS = 128  # fewer tokens than this per micro-batch: do not cut
EXPERT_COUNTS = "tokens_per_expert"  # rank 0's request for the MoE load metric
EXPERT_TAG = 1 << 20  # its messages' tag, apart from the micro-batches' 0, 1, ...
Logits = tuple[torch.Tensor | None, dict[str, tuple[int, torch.Tensor]]]


def micro_batch_count(num_tokens: int, pp_size: int) -> int:
    """How many micro-batches a step is cut into under pipeline parallelism.

    Only a compute-bound step gains: stage s+1 computes micro-batch 1 while stage s
    computes micro-batch 2. A small decode step is bound by reading the weights, and
    every micro-batch reads all of its stage's weights again (measured, PP=2, 8
    decodes of a 58M Llama: 17.8 ms per step whole, 32.5 ms in two micro-batches).
    So each micro-batch gets at least MICRO_BATCH_MIN_TOKENS tokens."""
    return max(1, min(pp_size, num_tokens // MICRO_BATCH_MIN_TOKENS))


def split_micro_batches(scheduled: list, n: int) -> list[list]:
    """At most `n` contiguous groups of sequences with about equal token counts."""
    if n == 1 or len(scheduled) <= 1:
        return [scheduled]
    total = sum(k for _, k in scheduled)
    groups: list[list] = [[]]
    done = 0
    for i, item in enumerate(scheduled):
        groups[-1].append(item)
        done += item[1]
        left = len(scheduled) - i - 1
        if len(groups) < n and left and done >= total * len(groups) / n:
            groups.append([])
    return groups


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: Parallel = SINGLE):
        self.config = config
        self.parallel = parallel
        self.device = config.torch_device
        self.on_cpu = config.on_cpu
        # fp32 on CPU (see KV_DTYPE_CPU); the model's dtype on a GPU
        self.kv_dtype = KV_DTYPE_CPU if self.on_cpu else config.torch_dtype
        self.model = load_model(config, parallel)
        # C or torch, decided once: the C kernels run fp32 on the CPU
        use_c = self.on_cpu and config.torch_dtype is torch.float32
        self.kernels = kernels.get() if use_c else None
        kernels.attach(self.model, self.kernels)
        self.attentions = self.model.attentions
        self.num_blocks = self.plan_num_blocks()
        if parallel.world_size > 1:  # every rank's pool has the same number of blocks
            timeout = timedelta(seconds=config.startup_timeout_s)
            self.num_blocks = parallel.min_over_ranks(self.num_blocks, self.device, timeout)
        self.allocate_kv_cache()
        self.workspace = GatherWorkspace()
        self.flash = self.pick_flash_attn()
        # dynamic / longrope RoPE: each row's rotation depends on its sequence (rope.py)
        self.rope_rows = not RopeRegime(config.hf_config).static

    def pick_flash_attn(self):
        """flash-attn on cuda for fp16/bf16 when it imports; None means torch SDPA."""
        if self.on_cpu or self.kv_dtype not in (torch.float16, torch.bfloat16):
            return None
        return flash_attn()

    # -- the KV pool ------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        attn = self.attentions[0]
        per_layer = 2 * attn.num_kv_heads * self.config.block_size * attn.head_dim
        return per_layer * len(self.attentions) * self.kv_dtype.itemsize

    def plan_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        num_blocks = self.config.kv_cache_memory // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory} bytes holds no KV block "
                f"({self.bytes_per_block()} bytes each)"
            )
        return num_blocks

    def allocate_kv_cache(self) -> None:
        """Per layer, K and V pools `[kv_heads, num_blocks, block_size, head_dim]`."""
        for attn in self.attentions:
            shape = (attn.num_kv_heads, self.num_blocks, self.config.block_size, attn.head_dim)
            if self.on_cpu:
                attn.kv_cache = (
                    kernels.zeros_huge_pages(shape, self.kv_dtype),
                    kernels.zeros_huge_pages(shape, self.kv_dtype),
                )
            else:
                attn.kv_cache = (
                    torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                    torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                )

    # -- one step ---------------------------------------------------------------------
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.on_cpu else t.to(self.device, non_blocking=True)

    def plan(self, batch: SchedulerOutput) -> tuple[list[StepInput], ModelOutput]:
        """The step's inputs: one, or one per micro-batch under pipeline parallelism."""
        out = ModelOutput()
        n = 1
        if self.parallel.pp_size > 1:
            n = micro_batch_count(batch.num_tokens, self.parallel.pp_size)
        groups = split_micro_batches(batch.scheduled, n)
        return [self.plan_one(group, out) for group in groups], out

    def plan_one(self, scheduled: list[tuple[Sequence, int]], out: ModelOutput) -> StepInput:
        step = StepInput()
        input_ids, positions, slots = step.input_ids, step.positions, step.slots
        dec_tables, dec_ends, dec_rows = [], [], []
        batched_decode = self.kernels is not None
        bs, row = self.config.block_size, 0
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if table[0] < 0:  # blocks freed behind a sliding window: never read
                table = [max(block, 0) for block in table]
            num_ctx_blocks = -(-end // bs)
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if batched_decode:
                dec_tables.append(table[:num_ctx_blocks])
                dec_ends.append(end)
                dec_rows.append(n)
            else:
                step.seqs.append((row, row + n, end, table[:num_ctx_blocks]))
            if self.rope_rows:
                step.rope_prefix.extend([seq.rope_prefix] * n)
            if end == seq.num_tokens:
                out.sample_seqs.append(seq)
                step.sample_rows.append(row + n - 1)
            if seq.wants_prompt_logprobs:
                last = min(end, seq.num_prompt_tokens - 1)  # rows predicting prompt tokens
                if last > start:
                    rows = list(range(row, row + last - start))
                    step.prompt_rows.append((seq.request_id, start + 1, rows))
            row += n
        if dec_tables:  # only with the C kernel, so only on the CPU
            width = max(len(t) for t in dec_tables)
            tables = [t + [0] * (width - len(t)) for t in dec_tables]
            step.decode = (tables, dec_ends, dec_rows)
        return step

    def build(self, step: StepInput) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
        tensors = (torch.tensor(step.input_ids), torch.tensor(step.positions))
        tensors += (torch.tensor(step.slots),)
        if not self.on_cpu:
            tensors = tuple(self.to_device(t) for t in tensors)
        slices = [
            SeqSlice(start, end, context, self.to_device(torch.tensor(table)))
            for start, end, context, table in step.seqs
        ]
        meta = AttentionMetadata(tensors[2], slices, self.workspace, flash=self.flash)
        if step.rope_prefix:
            meta.rope_prefix = self.to_device(torch.tensor(step.rope_prefix, dtype=torch.int64))
        if step.decode is not None:
            tables, ends, rows = step.decode
            seq_of = torch.repeat_interleave(torch.tensor(rows))  # each row's sequence
            positions = tensors[1].to(torch.int32)
            meta.decode = DecodeBatch(
                torch.arange(len(positions), dtype=torch.int32),
                torch.tensor(tables, dtype=torch.int32)[seq_of],
                positions + 1,  # a row at position p attends keys 0 .. p
                torch.tensor(ends, dtype=torch.int32)[seq_of],
            )
        return tensors, meta

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Rank 0: plan the step, send it to the other ranks, run, collect the logits."""
        steps, out = self.plan(batch)
        if self.parallel.world_size > 1:
            self.parallel.broadcast_object(steps)
        results = self.run(steps)
        if len(results) == 1:
            out.logits, out.prompt_logits = results[0]
            return out
        sample = [logits for logits, _ in results if logits is not None]
        out.logits = torch.cat(sample) if sample else None
        for _, prompt in results:
            out.prompt_logits.update(prompt)
        return out

    @torch.inference_mode()
    def run(self, steps: list[StepInput]) -> list[Logits]:
        """This rank's share of a step, micro-batch after micro-batch: receive the
        previous stage's hidden states, run this stage's layers, send them on without
        waiting (the next micro-batch starts while the next stage works). Returns the
        logits of each micro-batch on rank 0, nothing on the other ranks."""
        par = self.parallel
        results: list[Logits] = []
        sending = []
        for tag, step in enumerate(steps):
            (input_ids, positions, _), meta = self.build(step)
            hidden = None
            if not par.is_first_stage:
                hidden = par.recv_prev(self.hidden_buffer(len(step.input_ids)), tag)
            hidden = self.model(input_ids, positions, meta, hidden)
            if not par.is_last_stage:
                sending.append((par.send_next(hidden, tag), hidden))
            elif par.samples:
                results.append(self.compute_logits(hidden, step))
        for work, _ in sending:
            work.wait()
        if par.pp_size > 1:
            results = self.logits_to_rank0(steps, results)
        return results

    # -- the per-expert load metric ---------------------------------------------------
    def tokens_per_expert(self) -> list[int]:
        """Rank 0: tokens routed to each expert over all layers (empty for a dense model).
        Each stage counts its own layers; under pipeline parallelism rank 0 asks every
        other stage's TP rank 0 for its counts (TP ranks route alike: one is enough)."""
        counts = getattr(self.model, "tokens_per_expert", None)
        if counts is None:
            return []
        total = torch.tensor(counts(), dtype=torch.int64)
        if self.parallel.pp_size > 1:
            self.parallel.broadcast_object(EXPERT_COUNTS)
            for stage in range(1, self.parallel.pp_size):
                src = stage * self.parallel.tp.size
                total += self.parallel.recv(torch.zeros_like(total), src, EXPERT_TAG)
        return total.tolist()

    def send_tokens_per_expert(self) -> None:
        """A worker's side of `tokens_per_expert`."""
        par = self.parallel
        if par.tp.rank == 0 and par.rank != 0:
            counts = torch.tensor(self.model.tokens_per_expert(), dtype=torch.int64)
            par.send(counts, 0, EXPERT_TAG).wait()

    def compute_logits(self, hidden: torch.Tensor, step: StepInput) -> Logits:
        logits = None
        if step.sample_rows:
            logits = self.model.compute_logits(hidden[step.sample_rows]).float()
        prompt = {
            request_id: (first, self.model.compute_logits(hidden[rows]).float())
            for request_id, first, rows in step.prompt_rows
        }
        return logits, prompt

    def hidden_buffer(self, num_tokens: int) -> torch.Tensor:
        hf = self.config.hf_config
        hidden = hf.get("hidden_size") or hf["n_embd"]
        return torch.empty(num_tokens, hidden, dtype=self.config.torch_dtype, device=self.device)

    def logits_to_rank0(self, steps: list[StepInput], results: list[Logits]) -> list[Logits]:
        """Pipeline parallelism: the last stage sends each micro-batch's logits (sample
        rows, then prompt rows) to rank 0, which samples."""
        par = self.parallel
        if par.samples:
            works = []
            for tag, (logits, prompt) in enumerate(results):
                parts = ([] if logits is None else [logits]) + [p for _, p in prompt.values()]
                if not parts:  # a prefill chunk that samples nothing: nothing to send
                    continue
                packed = torch.cat(parts)
                works.append((par.send(packed, 0, tag), packed))
            for work, _ in works:
                work.wait()
            return []
        if par.rank != 0:
            return []
        vocab = self.config.hf_config["vocab_size"]
        received: list[Logits] = []
        for tag, step in enumerate(steps):
            sizes = [len(step.sample_rows)] + [len(rows) for _, _, rows in step.prompt_rows]
            if not sum(sizes):
                received.append((None, {}))
                continue
            packed = torch.empty(sum(sizes), vocab, dtype=torch.float32, device=self.device)
            parts = par.recv(packed, par.sampler_rank, tag).split(sizes)
            logits = parts[0] if step.sample_rows else None
            prompt = {
                request_id: (first, part)
                for (request_id, first, _), part in zip(step.prompt_rows, parts[1:], strict=True)
            }
            received.append((logits, prompt))
        return received
