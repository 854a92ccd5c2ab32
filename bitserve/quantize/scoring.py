"""Run an engine model over windows of held-out text: logits for perplexity and calibration.

One window is one fresh prefill through the model's own forward (the same paged
attention the server runs), with a KV pool just big enough for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from bitserve.llm.attention import AttentionMetadata, GatherWorkspace, SeqSlice
from bitserve.llm.engine import load_tokenizer

BLOCK = 16


def text_token_ids(folder: Path, text: str) -> list[int]:
    """The whole text, newlines included, as token ids without special tokens (as
    tools/train_lm.py scores tinylm's held-out perplexity). `folder`: the engine's
    (`EngineConfig.model`, a GGUF file's companion folder already)."""
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"{folder}: no tokenizer, cannot tokenize the text")
    tokenizer.model_max_length = 1 << 40  # the text is cut into windows afterwards
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def windows(ids: list[int], window: int, max_tokens: int | None = None) -> Iterator[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens, the last partial one
    dropped (unless it is the only one); at most `max_tokens` tokens in all."""
    ids = ids[:max_tokens] if max_tokens else ids
    full = len(ids) // window
    if full == 0 and len(ids) >= 2:
        yield ids
    for i in range(full):
        yield ids[i * window : (i + 1) * window]


def attach_kv_cache(model: nn.Module, tokens: int) -> None:
    """Give every attention layer a pool that holds one window."""
    blocks = -(-tokens // BLOCK)
    for attn in model.attentions:
        device = next(model.parameters()).device
        shape = (attn.num_kv_heads, blocks, BLOCK, attn.head_dim)
        attn.kv_cache = (torch.zeros(shape, device=device), torch.zeros(shape, device=device))


@torch.inference_mode()
def window_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab]: row i predicts token i + 1."""
    device = next(model.parameters()).device
    n = len(ids)
    attentions = model.attentions
    if attentions[0].kv_cache is None or attentions[0].kv_cache[0].shape[1] * BLOCK < n:
        attach_kv_cache(model, n)
    table = torch.arange(-(-n // BLOCK), device=device)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(positions, [SeqSlice(0, n, n, table)], GatherWorkspace())
    meta.rope_prefix = torch.full_like(positions, n)  # one forward over the window (llm/rope.py)
    hidden = model(torch.tensor(ids, device=device), positions, meta)
    return model.compute_logits(hidden).float()
