"""One image request's parameters, validated once at the boundary.

Every protocol (v2 infer, /v1/images/generations, `bitserve eval`) builds a
`GenerationParams`; a bad value raises `InvalidParams` (a ValueError: HTTP 400) whose
message names the field, before anything is queued.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from bitserve.inference import InvalidRequest

MAX_STEPS = 1000  # the training timesteps T; a sampler cannot take more
MAX_GUIDANCE = 100.0
MAX_SEED = 2**63 - 1

DIGIT_WORDS = {
    w: i
    for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    )
}
NULL_WORDS = {"", "none", "null", "any", "unconditional", "a digit", "digit"}


class InvalidParams(InvalidRequest):
    """A caller's mistake; the message names the field ("field 'steps': ...")."""

    @property
    def field(self) -> str | None:
        message = str(self)
        return message.split("'")[1] if message.startswith("field '") else None


@dataclass(frozen=True)
class GenerationParams:
    label: int | None  # 0..classes-1, or None: unconditional
    guidance_scale: float = 3.0
    steps: int = 30
    seed: int | None = None  # None: the engine draws one
    eta: float = 0.0  # 0: deterministic DDIM; 1: DDPM's ancestral sampling

    def check(self, classes: int = 10, max_steps: int = MAX_STEPS) -> GenerationParams:
        """Self, or InvalidParams naming the first bad field."""
        if self.label is not None and not 0 <= self.label < classes:
            raise InvalidParams(
                f"field 'label': {self.label} is not a known label; this model knows "
                f"0..{classes - 1} (or -1 / null for unconditional)"
            )
        _number("guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE)
        if not 1 <= self.steps <= max_steps:
            raise InvalidParams(f"field 'steps': {self.steps} is outside 1..{max_steps}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidParams(f"field 'seed': {self.seed} is outside 0..2^63-1")
        _number("eta", self.eta, 0.0, 1.0)
        return self

    @property
    def halves(self) -> tuple[bool, bool]:
        """(conditional, unconditional): which passes eps = eps_u + s (eps_c - eps_u)
        needs. s = 1 is the conditional model alone, s = 0 the unconditional alone, and
        a null label has only the unconditional; only the rest pay for both."""
        if self.label is None or self.guidance_scale == 0.0:
            return False, True
        return True, self.guidance_scale != 1.0


def _number(field: str, value: float, low: float, high: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise InvalidParams(f"field '{field}' must be a number")
    if not low <= value <= high:
        raise InvalidParams(f"field '{field}': {value} is outside {low:g}..{high:g}")


def parse_label(prompt: object) -> int | None:
    """A digit from a prompt: "7", "seven", "a seven", "digit 7", or None for "" /
    "none" (unconditional). Anything else is InvalidParams naming 'prompt'."""
    if not isinstance(prompt, str):
        raise InvalidParams("field 'prompt' must be a string")
    text = re.sub(r"[^a-z0-9 ]", " ", prompt.lower())
    text = " ".join(w for w in text.split() if w not in {"a", "an", "the", "digit", "number"})
    if text in NULL_WORDS or prompt.strip().lower() in NULL_WORDS:
        return None
    if text.isdigit() and len(text) == 1:
        return int(text)
    if text in DIGIT_WORDS:
        return DIGIT_WORDS[text]
    raise InvalidParams(
        f"field 'prompt': {prompt!r} is not a digit; give one as a numeral (\"7\") or a "
        'word ("seven"), or "none" for any digit'
    )
