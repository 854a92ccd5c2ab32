"""Per-request sampling and stopping settings, vLLM's `SamplingParams` vocabulary.

This is the one schema of sampling parameters: every boundary (the OpenAI API, v2
generate and infer, batch files, `LLM.generate`) ends here, and nothing reaches a step
that the sampler cannot take. Types are strict (no string or bool where a number goes,
no silent coercion) and every range is finite and means something. `LIMITS` is what
the published OpenAPI schema shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from bitserve.llm.structured import Guide

# Below this a temperature is greedy (vLLM's _SAMPLING_EPS); up to MIN_TEMPERATURE it is
# raised to MIN_TEMPERATURE (vLLM's _MAX_TEMP clamp): logits / 1e-300 overflow to inf.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
MAX_LOGPROBS = 20

# field -> (lowest, highest), both inclusive; lower bounds marked open in OPEN_BELOW.
LIMITS: dict[str, tuple[float, float]] = {
    "max_tokens": (1, 2**31 - 1),
    "min_tokens": (0, 2**31 - 1),
    "temperature": (0.0, 2.0),  # OpenAI's range, on every door
    "top_k": (-1, 2**31 - 1),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "seed": INT64,
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
}
OPEN_BELOW = {"top_p"}  # top_p = 0 keeps nothing


class SamplingError(ValueError):
    """A sampling parameter the engine cannot take (400 naming `field`)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy. Stop strings are cut from the text; stop token ids
    stay in the token ids (vLLM semantics). `logprobs=n` returns the sampled token's
    log-probability plus the top n; `prompt_logprobs=n` does the same for the prompt.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    guide: Guide | None = None  # structured output: a JSON schema, regex, choice or grammar
    lora: str | None = None  # the LoRA adapter to generate with (llm/lora.py); None: the base
    speculative: bool = True  # False: never speculated (the model's `speculative` config)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, f.type, getattr(self, f.name))
        for name, (low, high) in LIMITS.items():
            _check_range(name, getattr(self, name), low, high)
        if self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", "must not exceed max_tokens")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise SamplingError(
                "stop", f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_LENGTH} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids", "token ids must be >= 0")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must name tokens of the model (the engine calls this at admission)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingError(
                "stop_token_ids", f"ids {bad[:4]} are not below the vocabulary size {vocab_size}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_type(name: str, annotation: str, value: object) -> None:
    """Strict types from the annotation text: `int | None`, `list[int]`, `list[str] | str`."""
    options = [a.strip() for a in annotation.split("|")]
    for option in options:
        if option == "None" and value is None:
            return
        if option == "Guide" and isinstance(value, Guide):
            return
        if option.startswith("list[") and isinstance(value, list):
            inner = _KINDS[option[5:-1]]
            if all(_is(item, inner) for item in value):
                return
        elif option in _KINDS and _is(value, _KINDS[option]):
            return
    raise SamplingError(name, f"must be {' or '.join(options)}, got {_describe(value)}")


def _is(value: object, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}"


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise SamplingError(name, f"must be a finite number, got {value}")
    below = value <= low if name in OPEN_BELOW else value < low
    if below or value > high:
        opening = "(" if name in OPEN_BELOW else "["
        raise SamplingError(name, f"must be in {opening}{low}, {high}], got {value}")
