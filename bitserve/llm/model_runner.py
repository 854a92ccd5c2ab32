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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bitserve.llm import kernels
from bitserve.llm.attention import (
    AttentionMetadata,
    DecodeBatch,
    GatherWorkspace,
    SeqSlice,
    flash_attn,
)
from bitserve.llm.config import EngineConfig
from bitserve.llm.models import load_model
from bitserve.llm.scheduler import SchedulerOutput
from bitserve.llm.sequence import Sequence

KV_DTYPE_CPU = torch.float32  # bf16 SDPA on CPU is 4-8x slower (research/cpu-facts.md §2)


@dataclass
class ModelOutput:
    sample_seqs: list[Sequence] = field(default_factory=list)  # those that get a new token
    logits: torch.Tensor | None = None  # [len(sample_seqs), vocab], fp32
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # request_id -> (first position predicted, logits rows [n, vocab])


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device
        self.on_cpu = config.on_cpu
        # fp32 on CPU (see KV_DTYPE_CPU); the model's dtype on a GPU
        self.kv_dtype = KV_DTYPE_CPU if self.on_cpu else config.torch_dtype
        self.model = load_model(config)
        self.attentions = self.model.attentions
        self.num_blocks = self.plan_num_blocks()
        self.allocate_kv_cache()
        self.workspace = GatherWorkspace()
        self.flash = self.pick_flash_attn()

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
    def use_decode_kernel(self) -> bool:
        return (
            self.on_cpu and self.config.torch_dtype is torch.float32 and kernels.get() is not None
        )

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.on_cpu else t.to(self.device, non_blocking=True)

    def prepare(self, batch: SchedulerOutput):
        input_ids, positions, slots, slices, sample_rows = [], [], [], [], []
        dec_rows, dec_tables, dec_lens = [], [], []
        batched_decode = self.use_decode_kernel()
        out = ModelOutput()
        bs, row = self.config.block_size, 0
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        for seq, n in batch.scheduled:
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            num_ctx_blocks = -(-end // bs)
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if batched_decode and n == 1 and start > 0:
                dec_rows.append(row)
                dec_tables.append(table[:num_ctx_blocks])
                dec_lens.append(end)
            else:
                block_table = self.to_device(torch.tensor(table[:num_ctx_blocks]))
                slices.append(SeqSlice(row, row + n, end, block_table))
            if end == seq.num_tokens:
                out.sample_seqs.append(seq)
                sample_rows.append(row + n - 1)
            if seq.wants_prompt_logprobs:
                last = min(end, seq.num_prompt_tokens - 1)  # rows predicting prompt tokens
                if last > start:
                    prompt_rows[seq.request_id] = (start + 1, list(range(row, row + last - start)))
            row += n
        tensors = (torch.tensor(input_ids), torch.tensor(positions), torch.tensor(slots))
        if not self.on_cpu:
            tensors = tuple(self.to_device(t) for t in tensors)
        meta = AttentionMetadata(tensors[2], slices, self.workspace, flash=self.flash)
        if dec_rows:  # only with the C kernel, so only on the CPU
            width = max(len(t) for t in dec_tables)
            meta.decode = DecodeBatch(
                torch.tensor(dec_rows, dtype=torch.int32),
                torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.int32),
                torch.tensor(dec_lens, dtype=torch.int32),
            )
        return tensors, meta, out, sample_rows, prompt_rows

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        (input_ids, positions, _), meta, out, sample_rows, prompt_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if sample_rows:
            out.logits = self.model.compute_logits(hidden[sample_rows]).float()
        for request_id, (first, rows) in prompt_rows.items():
            out.prompt_logits[request_id] = (first, self.model.compute_logits(hidden[rows]).float())
        return out
