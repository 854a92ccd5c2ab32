"""Phi-3 and Phi-4-mini: the Llama decoder whose checkpoints already fuse `qkv_proj`
and `gate_up_proj` (cut into q, k, v and gate, up on load, so tensor parallelism
shards them like any other), with longrope/su RoPE scaling, partial rotary
(`partial_rotary_factor`, Phi-4-mini) and tied embeddings where config.json says so.

Full-width rotary (Phi-3) decodes through the fused C layer; partial rotary rotates
in torch, so Phi-4-mini decodes layer by layer (the C layer rotates whole heads).
"""

from __future__ import annotations

from bitserve.llm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
