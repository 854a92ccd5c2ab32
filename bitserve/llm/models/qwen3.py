"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE (qk-norm),
no q/k/v bias, and an explicit `head_dim`. Sliding windows, when config.json turns them
on (`use_sliding_window`, from `max_window_layers` on), come from the shared layers."""

from __future__ import annotations

from bitserve.llm.models.llama import LlamaForCausalLM, Style


class Qwen3ForCausalLM(LlamaForCausalLM):
    style = Style(qk_norm=True)
