"""Turns a scheduler decision into one forward pass over a flattened, padding-free batch.

All scheduled tokens of all requests are concatenated into one row each
(`input_ids`, `positions`); `slot_mapping` says where each token's K/V goes in the
block pool, and each request's block table says where its context lives. Only the
rows that need a next token (the last row of a request whose prompt is done) go
through the LM head, plus prompt rows when prompt logprobs were asked for.

Everything lives on `config.device`: weights, the KV pool, RoPE tables and the
per-step index tensors. Those are fixed-shape pieces of one preallocated host buffer
(pinned on cuda), written with numpy and copied over in one non_blocking copy; the
device side views the same offsets (`StepBuffers`). Every row of a step, decode or
prompt, is one row of a `DecodeBatch` that the layer's attention takes in one call
(attention.py): the C kernel on the CPU, Triton's on cuda, else torch ops whose count
does not depend on the batch. The C kernels and the huge-page pool are CPU-only; on
cuda the pool is a plain `torch.zeros` in the model's dtype.

CUDA graphs (cuda, unless `enforce_eager`): at load, after a warm-up run, the model
forward of a pure decode step is captured once per batch-size bucket (1, 2, 4, ...,
max_num_seqs, at most GRAPH_MAX_BATCH) on the static buffers; a pure decode step is
padded to its bucket (padded rows write their K/V to a scratch block past the pool the
block manager hands out, their outputs are dropped) and replayed, any other step runs
eagerly. The graphs' memory is reserved out of the KV budget. The graph class is
injected (`graph_factory`), so the CPU tests run the same capture/replay logic with a
stand-in that calls the captured function.

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

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from bitserve import kernels
from bitserve.llm.attention import (
    AttentionMetadata,
    DecodeBatch,
    GatherWorkspace,
    SeqSlice,
    flash_attn,
    torch_paged_decode,
)
from bitserve.llm.config import EngineConfig
from bitserve.llm.lora import LoRAManager
from bitserve.llm.models import load_model
from bitserve.llm.parallel import SINGLE, Parallel
from bitserve.llm.rope import RopeRegime
from bitserve.llm.scheduler import SchedulerOutput
from bitserve.llm.sequence import Sequence

log = logging.getLogger(__name__)

KV_DTYPE_CPU = torch.float32  # bf16 SDPA on CPU is several times slower than fp32
GRAPH_MAX_BATCH = 256  # the largest batch-size bucket captured as a CUDA graph


@dataclass
class ModelOutput:
    # those that get a new token, one per logits row (a speculative row: 1 + its proposals)
    sample_seqs: list[Sequence] = field(default_factory=list)
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
    # the batched attention (all but flash-attn), every row in order: (each sequence's
    # block table padded with 0, its context_len after the step, its number of rows); a
    # row attends keys 0 .. its position
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[str, int, list[int]]] = field(default_factory=list)
    # (request_id, first position predicted, rows) for prompt logprobs
    rope_prefix: list[int] = field(default_factory=list)  # each row's seq.rope_prefix, or
    # none when the model's RoPE does not depend on the sequence (rope.py)
    lora: list[int] = field(default_factory=list)  # each row's adapter uid (lora.py), 0: none


@dataclass
class StepTensors:
    """One (micro-)batch's tensors on the device, as `build` makes them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # the rows that go through the LM head, int64
    counted: torch.Tensor | None = None  # 1 for a real row, 0 for a padded one (graphs)


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


class StepBuffers:
    """One step's index tensors in one preallocated host buffer (pinned on cuda), copied
    to the device in one non_blocking copy; both sides view the same offsets.

    Layout for T rows, tables W blocks wide and S sampled rows, packed from offset 0:
    int64 input_ids, positions, slots, counted [T]; int32 context_lens, seq_lens [T],
    block tables [T, W]; int64 sample rows [S]. Every offset but the sample rows' follows
    from (T, W) only, so a CUDA graph captured for (B, max_width) reads the same
    addresses at every replay. On the CPU the host buffer is the device buffer."""

    def __init__(self, max_rows: int, max_width: int, device: torch.device):
        self.max_rows, self.max_width, self.device = max_rows, max_width, device
        _, nbytes = self.layout(max_rows, max_width, max_rows)
        on_cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.array = self.host.numpy()
        self.device_buffer = None
        if on_cuda:
            self.device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.rows = torch.arange(max_rows, dtype=torch.int32, device=device)  # constant
        self.uploaded: Any = None  # the last upload's cuda event
        self._views: dict[tuple[int, int, int], tuple] = {}

    @staticmethod
    def layout(rows: int, width: int, samples: int) -> tuple[list[tuple[int, int]], int]:
        """Each piece's (start, end) in bytes, and the bytes used."""
        sizes = [8 * rows] * 4 + [4 * rows] * 2 + [4 * rows * width, 8 * samples]
        pieces, end = [], 0
        for size in sizes:
            start = -(-end // 8) * 8  # every piece 8-byte aligned
            pieces.append((start, start + size))
            end = start + size
        return pieces, end

    def views(self, rows: int, width: int, samples: int) -> tuple:
        """(host numpy pieces, device tensor pieces, bytes used) for this shape."""
        key = (rows, width, samples)
        views = self._views.get(key)
        if views is None:
            if rows > self.max_rows or width > self.max_width:
                raise ValueError(
                    f"a step of {rows} rows x {width} blocks exceeds the step buffers "
                    f"({self.max_rows} x {self.max_width})"
                )
            pieces, nbytes = self.layout(rows, width, samples)
            kinds = [np.int64] * 4 + [np.int32] * 3 + [np.int64]
            host = [self.array[a:b].view(k) for (a, b), k in zip(pieces, kinds, strict=True)]
            host[6] = host[6].reshape(rows, width)
            if self.device_buffer is None:  # the CPU: the host buffer itself
                dev = [torch.from_numpy(h) for h in host]
            else:
                dtypes = [torch.int64] * 4 + [torch.int32] * 3 + [torch.int64]
                buf = self.device_buffer
                dev = [buf[a:b].view(d) for (a, b), d in zip(pieces, dtypes, strict=True)]
                dev[6] = dev[6].view(rows, width)
            if len(self._views) > 256:
                self._views.clear()
            views = self._views[key] = (host, dev, nbytes)
        return views

    def wait(self) -> None:
        """Before the host pieces are written again: the last upload has read them."""
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def upload(self, nbytes: int) -> None:
        if self.device_buffer is not None:
            self.device_buffer[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: powers of two up to max_num_seqs, and max_num_seqs
    itself (at most GRAPH_MAX_BATCH)."""
    top = min(max_num_seqs, GRAPH_MAX_BATCH)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sizes if sizes[-1] == top else [*sizes, top]


class CudaGraph:
    """`torch.cuda.CUDAGraph` as the runner uses it: capture(fn), then replay()."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


def graph_factory(config: EngineConfig):
    """What makes one graph (all sharing one memory pool), or None on the CPU (eager
    only). Tests replace it to run the capture/replay logic on the CPU."""
    if config.on_cpu:
        return None
    try:
        pool = torch.cuda.graph_pool_handle()
    except RuntimeError as e:  # a torch without CUDA graphs (the tests' pretend device)
        log.warning("CUDA graphs are not available here (%s): decode steps run eager", e)
        return None
    return lambda: CudaGraph(pool)


def triton_paged_decode():
    """The Triton paged attention (triton_attention.py) when triton and a GPU are there;
    else None."""
    from bitserve.llm import triton_attention

    return triton_attention.paged_attention_triton if triton_attention.available() else None


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
        self.moe_layers = [m for m in self.model.modules() if hasattr(m, "row_mask")]
        self.flash = self.pick_flash_attn()
        self.paged = self.pick_paged_attention()
        self.store = None  # how K/V go into the pool (None: attention.write_kv)
        if self.paged is not torch_paged_decode and not self.on_cpu:
            from bitserve.llm.triton_attention import write_kv_triton

            self.store = write_kv_triton  # one launch for K and V
        # graphs replay the batched path only: not under TP/PP, nor with flash-attn's
        # dynamic / longrope RoPE: each row's rotation depends on its sequence (rope.py),
        # a per-step input the captured graphs do not have: those models run eager
        self.rope_rows = not RopeRegime(config.hf_config).static
        eager = config.enforce_eager or parallel.world_size > 1 or self.flash is not None
        eager = eager or self.rope_rows
        make_graph = None if eager else graph_factory(config)
        self.buckets = graph_buckets(config.max_num_seqs) if make_graph is not None else []
        self.num_blocks = self.plan_num_blocks()
        if parallel.world_size > 1:  # every rank's pool has the same number of blocks
            timeout = timedelta(seconds=config.startup_timeout_s)
            self.num_blocks = parallel.min_over_ranks(self.num_blocks, self.device, timeout)
        self.allocate_kv_cache()
        self.workspace = GatherWorkspace()
        bs = config.block_size
        max_rows = max(config.max_num_batched_tokens, config.max_num_seqs, *self.buckets)
        self.buffers = StepBuffers(max_rows, -(-config.max_model_len // bs), self.device)
        self.lora = None  # the LoRA adapters' slots and hooks (lora.py)
        if config.max_loras:
            rank = config.max_lora_rank
            self.lora = LoRAManager(self.model, config.max_loras, rank, max_rows, self.kernels)
        self.graphs: dict[int, Any] = {}
        if make_graph is not None:
            self.capture_graphs(make_graph)

    def pick_paged_attention(self):
        """The batched attention every row of a step goes through (unless flash-attn
        takes them per sequence): the C kernel, Triton's on cuda, else torch ops."""
        if self.kernels is not None:
            return self.kernels.paged_decode
        if not self.on_cpu:
            return triton_paged_decode() or torch_paged_decode
        return torch_paged_decode

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
        memory = self.config.kv_cache_memory - self.graph_reserve()
        num_blocks = memory // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory} bytes holds no KV block "
                f"({self.bytes_per_block()} bytes each, {self.graph_reserve()} bytes kept "
                "for CUDA graphs)"
            )
        return num_blocks

    def graph_reserve(self) -> int:
        """Bytes the CUDA graphs' pool is counted at inside the KV budget (0 without
        graphs): the largest bucket's activations (all buckets share one pool, captured
        largest first), rows x (residual, qkv, attention out, MLP) in the model's dtype,
        doubled for the temporaries, plus the torch attention's gather (GATHER_BYTES)
        when that is the attention."""
        if not self.buckets:
            return 0
        from bitserve.llm import attention

        gather = 2 * attention.GATHER_BYTES if self.paged is torch_paged_decode else 0
        hf, attn = self.config.hf_config, self.attentions[0]
        hidden = hf.get("hidden_size") or hf["n_embd"]
        inter = hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 4 * hidden
        per_row = 4 * hidden + attn.q_size + 2 * attn.kv_size + attn.q_size + 3 * inter
        per_row *= 2 * self.config.torch_dtype.itemsize
        return self.buckets[-1] * per_row + gather

    def allocate_kv_cache(self) -> None:
        """Per layer, K and V pools `[kv_heads, num_blocks, block_size, head_dim]`; with
        CUDA graphs one block more, past the ones the block manager hands out: the
        scratch that padded graph rows write to."""
        blocks = self.num_blocks + (1 if self.buckets else 0)
        for attn in self.attentions:
            shape = (attn.num_kv_heads, blocks, self.config.block_size, attn.head_dim)
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
        batched_decode = self.flash is None
        bs, row = self.config.block_size, 0
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if table[0] < 0:  # blocks freed behind a sliding window: never read
                table = [max(block, 0) for block in table]
            num_ctx_blocks = -(-end // bs)
            spec = end - seq.num_tokens  # > 0: a decode row scores its proposals too
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                tokens = seq.token_ids if spec <= 0 else seq.token_ids + seq.spec_token_ids
                input_ids.extend(tokens[start:end])
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
            if self.lora is not None:
                step.lora.extend([seq.lora_id] * n)
            if end == seq.num_tokens:
                out.sample_seqs.append(seq)
                step.sample_rows.append(row + n - 1)
            elif spec > 0:  # every row of a speculative decode is sampled: seq once each
                out.sample_seqs += [seq] * (spec + 1)
                step.sample_rows.extend(range(row + n - 1 - spec, row + n))
            if seq.wants_prompt_logprobs:
                last = min(end, seq.num_prompt_tokens - 1)  # rows predicting prompt tokens
                if last > start:
                    rows = list(range(row, row + last - start))
                    step.prompt_rows.append((seq.request_id, start + 1, rows))
            row += n
        if dec_tables:  # every path but flash-attn's
            width = max(len(t) for t in dec_tables)
            tables = [t + [0] * (width - len(t)) for t in dec_tables]
            step.decode = (tables, dec_ends, dec_rows)
        return step

    def build(self, step: StepInput, bucket: int | None = None) -> StepTensors:
        """The step's tensors on the device. `bucket`: a pure decode step padded to that
        many rows, its tables max_width wide (the shape its CUDA graph was captured with)."""
        if step.decode is None:
            return self.build_per_sequence(step)
        bufs = self.buffers
        tables, ends, counts = step.decode
        n = len(step.input_ids)
        rows = n if bucket is None else bucket
        width = (len(tables[0]) if tables else 1) if bucket is None else bufs.max_width
        host, dev, nbytes = bufs.views(rows, width, len(step.sample_rows))
        ids, pos, slots, counted, ctx, seq_lens, table, sample = host
        bufs.wait()
        ids[:n] = step.input_ids
        pos[:n] = step.positions
        slots[:n] = step.slots
        np.add(pos[:n], 1, out=ctx[:n], casting="unsafe")  # a row at p attends keys 0 .. p
        if len(tables) == n:  # every sequence one row: a decode step
            table[:n, : len(tables[0]) if tables else 0] = tables
            seq_lens[:n] = ends
        else:
            table[:n, :width] = np.repeat(np.array(tables, dtype=np.int32), counts, axis=0)
            seq_lens[:n] = np.repeat(ends, counts)
        if bucket is not None:  # padded rows: one key, in the scratch block
            if tables:
                table[:n, len(tables[0]) :] = 0
            ids[n:], pos[n:], ctx[n:], seq_lens[n:] = 0, 0, 1, 1
            slots[n:] = self.num_blocks * self.config.block_size
            table[n:] = 0
            table[n:, 0] = self.num_blocks
            counted[:n], counted[n:] = 1, 0
        sample[:] = step.sample_rows
        bufs.upload(nbytes)
        d_ids, d_pos, d_slots, d_counted, d_ctx, d_seq_lens, d_table, d_sample = dev
        decode = DecodeBatch(bufs.rows[:rows], d_table, d_ctx, d_seq_lens)
        meta = AttentionMetadata(d_slots, [], decode=decode, paged=self.paged, store=self.store)
        if step.rope_prefix:  # (never with a bucket: such models run eager)
            meta.rope_prefix = self.to_device(torch.tensor(step.rope_prefix, dtype=torch.int64))
        return StepTensors(d_ids, d_pos, meta, d_sample, d_counted if bucket else None)

    def build_per_sequence(self, step: StepInput) -> StepTensors:
        """flash-attn's path: each sequence its own slice and block table."""
        tensors = (torch.tensor(step.input_ids), torch.tensor(step.positions))
        tensors += (torch.tensor(step.slots),)
        tensors = tuple(self.to_device(t) for t in tensors)
        slices = [
            SeqSlice(start, end, context, self.to_device(torch.tensor(table)))
            for start, end, context, table in step.seqs
        ]
        meta = AttentionMetadata(tensors[2], slices, self.workspace, flash=self.flash)
        if step.rope_prefix:
            meta.rope_prefix = self.to_device(torch.tensor(step.rope_prefix, dtype=torch.int64))
        sample_rows = self.to_device(torch.tensor(step.sample_rows, dtype=torch.int64))
        return StepTensors(tensors[0], tensors[1], meta, sample_rows)

    def torch_threads(self, batch: SchedulerOutput) -> AbstractContextManager:
        """Around a step on the engine's thread: its torch ops on that thread alone where
        the C layer runs the step on the kernels' pool (kernels.torch_threads_here: torch's
        OpenMP workers would spin on the pool's cores); torch keeps its threads for a step
        its own layers run."""
        fuses = getattr(self.model, "fuses", None)
        if self.kernels is None or self.flash is not None or fuses is None:
            return nullcontext()
        return kernels.torch_threads_here(1) if fuses(batch.num_tokens) else nullcontext()

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

    # -- a draft model's proposal loop -----------------------------------------------
    @property
    def can_decode_steps(self) -> bool:
        """Whether `decode_steps` runs here: one process, the batched attention, RoPE
        that does not depend on the sequence, no LoRA."""
        return (
            self.parallel.world_size == 1
            and self.flash is None
            and not self.rope_rows
            and self.lora is None
        )

    @torch.inference_mode()
    def decode_steps(
        self, seqs: list[Sequence], steps: int, pick, stop=None, head=None
    ) -> torch.Tensor:
        """`steps` one-token decode steps of `seqs` (speculative decoding's draft loop),
        the fed-back token of each chosen by `pick(logits [n, vocab], step)` (int64 [n]
        on the device). Step 0 feeds each sequence's token at num_computed_tokens, every
        later step the previous pick (a caller that knows the next token makes `pick`
        return it); each has blocks for `steps` tokens from there (allocate_slots). The
        sequences are not changed here (the caller appends the tokens). One plan and one
        build for all steps: between steps the step buffers are moved on in place (token,
        position, slot, lengths) by a few tensor ops, with no Python per row and no copy
        to the host. `stop(logits, step)`, if given, ends the loop after a step by
        returning True. `head(hidden)`, if given, gives the logits `pick` and `stop` see
        (the model's full-vocabulary fp32 logits if not). On the CPU `pick` may return a
        numpy array. Returns the tokens, [steps run, n] on the device."""
        bs, n = self.config.block_size, len(seqs)
        step = StepInput(sample_rows=list(range(n)))
        tables, ends, slots_at = [], [], []  # slots_at: each row's slot at every step
        for seq in seqs:
            p = seq.num_computed_tokens
            table = [max(block, 0) for block in seq.block_table]  # freed behind a window
            step.input_ids.append(seq.token_ids[p])
            step.positions.append(p)
            slots_at.append([table[q // bs] * bs + q % bs for q in range(p, p + steps)])
            step.slots.append(slots_at[-1][0])
            tables.append(table[: -(-(p + steps) // bs)])
            ends.append(p + 1)
        # tables padded to a multiple of 8 blocks: the same buffers (and the stepper's
        # pointers cast for them) for 8 blocks of tokens, not one
        width = min(-(-max(len(t) for t in tables) // 8) * 8, self.buffers.max_width)
        step.decode = ([t + [0] * (width - len(t)) for t in tables], ends, [1] * n)
        bucket = self.graph_bucket(step)
        t = self.build(step, bucket)
        d = t.meta.decode
        ids, pos, slots = t.input_ids[:n], t.positions[:n], t.meta.slot_mapping[:n]
        ctx, lens, table = d.context_lens[:n], d.seq_lens[:n], d.block_tables[:n]
        stepper = None
        if hasattr(self.model, "fused_stepper") and bucket is None and not self.moe_layers:
            stepper = self.model.fused_stepper(t.input_ids, t.positions, t.meta)
        tokens = torch.empty(steps, n, dtype=torch.int64, device=self.device)
        if self.on_cpu:  # numpy views of the same memory: ~1 us an op where torch's is ~4
            host = [x.numpy() for x in (ids, pos, slots, ctx, lens, tokens)]
            n_ids, n_pos, n_slots, n_ctx, n_lens, n_tokens = host
            n_slots_at = np.array(slots_at, dtype=np.int64).T.copy()  # [steps, n]
        for s in range(steps):
            if bucket is not None:
                self.graphs[bucket].replay()
                hidden = self.graph_hidden[:n]
            elif stepper is not None:  # the C layers, pointers cast once (llama.py)
                hidden = stepper()
            else:
                hidden = self.forward(t)[:n]
            logits = self.model.compute_logits(hidden).float() if head is None else head(hidden)
            if self.on_cpu:
                n_tokens[s] = pick(logits, s)
            else:
                tokens[s] = pick(logits, s)
            if stop is not None and stop(logits, s):
                return tokens[: s + 1]
            if s + 1 < steps and self.on_cpu:
                n_ids[:] = n_tokens[s]
                for x in (n_pos, n_ctx, n_lens):
                    x += 1
                n_slots[:] = n_slots_at[s + 1]
            elif s + 1 < steps:  # the next step: the token just drawn, one position on
                ids.copy_(tokens[s])
                pos.add_(1)
                ctx.add_(1)
                lens.add_(1)
                block = table.gather(1, (pos // bs)[:, None])[:, 0]
                torch.add(pos % bs, block, alpha=bs, out=slots)
        return tokens

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
            bucket = self.graph_bucket(step)
            t = self.build(step, bucket)
            if self.lora is not None:
                self.lora.set_rows(step.lora, bucket or len(step.input_ids))
            if bucket is not None:
                self.graphs[bucket].replay()
                hidden = self.graph_hidden[:bucket]
            else:
                hidden = None
                if not par.is_first_stage:
                    hidden = par.recv_prev(self.hidden_buffer(len(step.input_ids)), tag)
                hidden = self.forward(t, hidden)
            if not par.is_last_stage:
                sending.append((par.send_next(hidden, tag), hidden))
            elif par.samples:
                results.append(self.compute_logits(hidden, step, t.sample_rows))
        for work, _ in sending:
            work.wait()
        if par.pp_size > 1:
            results = self.logits_to_rank0(steps, results)
        return results

    def forward(self, t: StepTensors, hidden: torch.Tensor | None = None) -> torch.Tensor:
        for moe in self.moe_layers:  # which rows the load metric counts (None: all)
            moe.row_mask = t.counted
        return self.model(t.input_ids, t.positions, t.meta, hidden)

    # -- CUDA graphs for pure decode steps ---------------------------------------------
    def graph_bucket(self, step: StepInput) -> int | None:
        """The bucket a step replays (None: eager): every row one sequence's decode."""
        if not self.graphs or step.decode is None or step.prompt_rows:
            return None
        n = len(step.input_ids)
        if n == 0 or len(step.decode[0]) != n or n > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= n)

    def capture_graphs(self, make_graph) -> None:
        """At load: per bucket, largest first (the smaller ones reuse its pool), build an
        all-padding decode step on the static buffers, run it once (warm-up), capture
        it. A captured forward writes its output into `graph_hidden`."""
        hf = self.config.hf_config
        hidden = hf.get("hidden_size") or hf["n_embd"]
        dtype, top = self.config.torch_dtype, self.buckets[-1]
        self.graph_hidden = torch.empty(top, hidden, dtype=dtype, device=self.device)
        before = torch.cuda.memory_reserved(self.device) if not self.on_cpu else 0
        empty = StepInput(decode=([], [], []))
        for bucket in reversed(self.buckets):
            t = self.build(empty, bucket)
            out = self.graph_hidden[:bucket]

            def forward(t=t, out=out) -> None:
                out.copy_(self.forward(t))

            with torch.inference_mode():
                forward()  # warm-up: lazy inits, kernel selection, allocator
                graph = make_graph()
                graph.capture(forward)
            self.graphs[bucket] = graph
        if not self.on_cpu:
            torch.cuda.synchronize(self.device)
            used = torch.cuda.memory_reserved(self.device) - before
            log.info(
                "captured %d CUDA graphs (batch %s): %.1f MiB, %.1f MiB kept for them",
                len(self.graphs),
                ",".join(map(str, self.buckets)),
                used / 2**20,
                self.graph_reserve() / 2**20,
            )

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

    def compute_logits(self, hidden: torch.Tensor, step: StepInput, sample_rows) -> Logits:
        logits = None
        if step.sample_rows:
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows)).float()
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
