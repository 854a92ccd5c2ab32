"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's departures, as `Style`.

- RMSNorm weights stored as w - 1 (`x * (1 + w)` in fp32), and four norms per layer:
  before and after attention, before and after the MLP (sandwich norms);
- embeddings times sqrt(hidden_size); GeGLU MLP (tanh-GELU, `hidden_activation`);
- attention scaled by `query_pre_attn_scalar ** -0.5`; sliding-window layers
  alternating with global ones (`layer_types`); Gemma 2 soft-caps attention scores
  and final logits (`attn_logit_softcapping`, `final_logit_softcapping`);
- Gemma 3 adds qk-norm and a RoPE of its own for sliding layers (`rope_local_base_freq`,
  or `rope_parameters["sliding_attention"]`).

Small decode steps go through the fused C decoder layer like Llama's: it takes the
sandwich norms, the `1 + w` multipliers, GeGLU, soft-capping, windows and each layer's
RoPE table (`LlamaForCausalLM.fused_rows`).
"""

from __future__ import annotations

from dataclasses import replace

from bitserve.llm.models.llama import LlamaForCausalLM, Style

GEMMA = Style(sandwich_norms=True, unit_offset_norms=True, scaled_embeddings=True)


class Gemma2ForCausalLM(LlamaForCausalLM):
    style = GEMMA


class Gemma3ForCausalLM(LlamaForCausalLM):
    style = replace(GEMMA, qk_norm=True, local_rope=True)  # Gemma 2's, plus these
