"""What a checkpoint's RoPE scaling means for the engine, outside the model's arithmetic
(that is `models/layers.py`): how long a context it allows, and which rotation each
token's key gets.

The context: `max_model_len` is derived from config.json as vLLM derives it. `linear`,
`dynamic` (and the others with a factor) stretch `max_position_embeddings` by it,
`yarn` stretches `original_max_position_embeddings`; `llama3` and `longrope`/`su`
checkpoints already state the stretched length in `max_position_embeddings`.

The rotation: two scalings depend on the sequence, as transformers applies them in
`generate` (`dynamic_rope_update`, and Phi-3's `prepare_inputs_for_generation`):
- `longrope`: a forward over a sequence longer than `original_max_position_embeddings`
  uses the long factors, a shorter one the short factors; when a sequence grows past
  that length, the Phi models (`RECOMPUTED`) drop the cache and compute the whole
  sequence again, long; the others keep the keys as they were computed.
- `dynamic` (NTK): a forward over L > max_position_embeddings tokens uses the base for
  L; the cache keeps every key with the base of the forward that computed it (no
  recompute: a prompt's keys have the prompt's base, a generated token at p that of p+1).
Both are one rule here. Each sequence has a `rope_prefix` S: the tokens transformers
computed in one forward, the prompt, or (longrope, after the switch) the whole sequence
at the switch. The token at position p is rotated as in a forward over
max(S, p + 1) tokens. The scheduler moves S at the switch and re-prefills (`switches`);
the prefix cache keys each block with `block_key`, so a block is reused only where the
rotation of its keys is the one the new sequence needs.
"""

from __future__ import annotations

from typing import Any

# where vLLM looks for the model's length (the smallest present wins)
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_LENGTH = 4096  # a config.json that states no length at all
# model types whose generate computes a longrope sequence again at the switch
RECOMPUTED = ("phi3", "phimoe", "phi4_multimodal")


def rope_parameters(hf: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older
    configs `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention", {})
    params = dict(params)
    theta = hf.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        theta = hf["rope_local_base_freq"]
        if "rope_parameters" not in hf:  # the old rope_scaling was for global layers only
            params = {}
    params.setdefault("rope_theta", theta)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":  # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    if "partial_rotary_factor" in hf:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if "original_max_position_embeddings" in hf:  # Phi-3 keeps it at the top level
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return params


def derived_max_len(hf: dict[str, Any]) -> int:
    """The longest context config.json allows, as vLLM's `_get_and_verify_max_len`
    derives it (Gemma 3's factor is for its global layers, not a longer context)."""
    lengths = [int(hf[key]) for key in LENGTH_KEYS if hf.get(key) is not None]
    length = min(lengths, default=DEFAULT_LENGTH)
    params = rope_parameters(hf, "full_attention")
    kind = params["rope_type"]
    if kind in ("default", "llama3", "longrope") or hf.get("model_type", "").startswith("gemma3"):
        return length
    if kind == "yarn" and params.get("original_max_position_embeddings"):
        length = int(params["original_max_position_embeddings"])
    return int(length * (params.get("factor") or 1.0))


class RopeRegime:
    """Which rotation a length gets, for the sequence-dependent scalings; None for the
    others (the rotation is the position's alone)."""

    def __init__(self, hf: dict[str, Any]):
        params = [rope_parameters(hf, t) for t in ("full_attention", "sliding_attention")]
        kinds = {p["rope_type"] for p in params}
        self.longrope = next((p for p in params if p["rope_type"] == "longrope"), None)
        self.dynamic = "dynamic" in kinds
        self.max_positions = int(hf.get("max_position_embeddings") or DEFAULT_LENGTH)
        self.switch = None  # longrope: past this length the long factors
        if self.longrope is not None:
            self.switch = int(
                self.longrope.get("original_max_position_embeddings") or self.max_positions
            )
        self.recompute = self.switch is not None and hf.get("model_type") in RECOMPUTED

    @property
    def static(self) -> bool:
        return self.switch is None and not self.dynamic

    def key(self, length: int) -> tuple | None:
        """What decides the rotation of a forward over `length` tokens."""
        if self.static:
            return None
        return (
            self.switch is not None and length > self.switch,
            max(length, self.max_positions) if self.dynamic else 0,
        )

    def block_key(self, rope_prefix: int, first_position: int) -> tuple | None:
        """A block whose first token is at `first_position`, of a sequence with this
        `rope_prefix`: its tokens at p are rotated for max(S, p + 1), so two blocks of
        equal tokens hold equal keys exactly when these keys are equal."""
        return self.key(max(rope_prefix, first_position + 1))

    def switches(self, rope_prefix: int, num_tokens: int) -> bool:
        """Longrope on a Phi model: the sequence has grown past the switch since its keys
        were rotated (all short): it must be computed again, whole, with the long factors."""
        return self.recompute and rope_prefix <= self.switch < num_tokens
