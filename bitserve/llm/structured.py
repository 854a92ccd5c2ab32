"""Structured outputs: a grammar engine (llguidance) keeps a request's tokens inside a
JSON schema, a regex, a list of choices or a Lark/GBNF grammar.

Why llguidance (vLLM's and llama.cpp's other choice is xgrammar): it takes JSON schema,
regex, Lark and GBNF (converted) without torch in its core, a grammar compiles in
well under a millisecond on first use, and it computes a row's next-token mask in a
few milliseconds with the GIL released, so masks are computed on a second thread while
the forward pass runs (engine.step) — measured in bench/structured.py.

Each request with a `Guide` gets its own matcher, a copy of a compiled template cached
by guide (compiled grammars are reused across requests with the same schema). The
sampler sets the tokens the matcher refuses to -inf; the engine feeds it every token
sampled and ends the request when the grammar is complete. Rows without a guide pay
nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

KINDS = ("json", "regex", "choice", "grammar", "lark")
CACHE_SIZE = 256
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A schema, regex or grammar the engine cannot enforce (400 naming `field`)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Guide:
    """What a request's output must match. `spec`: a JSON schema as JSON text ("" for
    any JSON object), a regex, a JSON list of choices, or a Lark or GBNF grammar.
    `field` names where it came from (for errors): response_format, guided_regex, ..."""

    kind: Literal["json", "regex", "choice", "grammar", "lark"]
    spec: str
    field: str = "response_format"

    @staticmethod
    def json_schema(schema: Any, field: str = "response_format") -> Guide:
        if schema is None:
            return Guide("json", "", field)
        return Guide("json", json.dumps(schema), field)  # key order is the output's order

    @staticmethod
    def choice(options: list[str], field: str = "guided_choice") -> Guide:
        if not options or not all(isinstance(o, str) for o in options):
            raise GuideError(field, "must be a non-empty list of strings")
        return Guide("choice", json.dumps(options), field)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guide_from(fields: dict[str, Any]) -> Guide | None:
    """The one guide a request asks for: OpenAI's `response_format` (a dict as sent), or
    vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`."""
    asked = {
        k: v
        for k, v in fields.items()
        if v is not None and k in (*GUIDED_FIELDS, "response_format")
    }
    fmt = asked.get("response_format")
    if fmt is not None and fmt.get("type") == "text":
        del asked["response_format"]
    if len(asked) > 1:
        raise GuideError(sorted(asked)[1], f"give one of {sorted(asked)}, not several")
    if not asked:
        return None
    ((name, value),) = asked.items()
    if name == "response_format":
        if fmt.get("type") == "json_object":
            return Guide.json_schema(None)
        schema = (fmt.get("json_schema") or {}).get("schema")
        return Guide.json_schema(schema if schema is not None else {}, "response_format")
    if name == "guided_json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            raise GuideError(name, f"is not JSON: {e}") from None
        return Guide.json_schema(schema, name)
    if name == "guided_choice":
        return Guide.choice(value, name)
    if not isinstance(value, str) or not value:
        raise GuideError(name, "must be a non-empty string")
    return Guide("regex" if name == "guided_regex" else "grammar", value, name)


def bounded(schema: Any, max_string: int) -> Any:
    """The schema with every free string at most `max_string` characters and no keys
    beyond the named properties (llguidance cannot bound a free key's length): a model
    that never writes a closing quote (tinylm learned from a text without one) would
    fill a string up to max_tokens and leave JSON that does not parse. Every output
    still validates against the original schema."""
    if isinstance(schema, list):
        return [bounded(item, max_string) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, max_string) for k, v in schema.items()}
    free = not {"enum", "const", "pattern", "format", "maxLength"} & set(out)
    if out.get("type") == "string" and free:
        out["maxLength"] = max(max_string, out.get("minLength", 0))
    if out.get("type") == "object" or "properties" in out:  # no free (unbounded) key names
        out["additionalProperties"] = False
    return out


def bounded_object(max_string: int) -> str:
    """`json_object` with bounded strings (llguidance bounds no free property names): a
    flat object of at most 8 keys, each value a bounded string, integer, bool or null."""
    value = {"type": ["string", "integer", "boolean", "null"], "maxLength": max_string}
    return (
        'start: "{" (pair (", " pair)~0..7)? "}"\n'
        'pair: KEY ": " value\n'
        f'KEY: /"[a-zA-Z0-9_ ]{{1,{max_string}}}"/\n'
        f"value: %json {json.dumps(value)}\n"
    )


def grammar_text(guide: Guide, max_string: int | None = None) -> str:
    """The guide as the grammar llguidance compiles."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if guide.kind == "json" and not guide.spec and max_string is not None:
        return LLMatcher.grammar_from_lark(bounded_object(max_string))
    if guide.kind == "json":  # compact JSON: a model that knows no JSON pads with spaces
        schema = guide.spec or '{"type": "object"}'
        if max_string is not None:
            schema = json.dumps(bounded(json.loads(schema), max_string))
        return LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    if guide.kind == "regex":
        return LLMatcher.grammar_from_regex(guide.spec)
    if guide.kind == "lark":  # written by bitserve itself (tool calls)
        return LLMatcher.grammar_from_lark(guide.spec)
    if guide.kind == "choice":
        options = " | ".join(json.dumps(o) for o in json.loads(guide.spec))
        return LLMatcher.grammar_from_lark(f"start: {options}")
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(guide.spec))
    except Exception as e:  # the GBNF converter's own errors
        raise GuideError(guide.field, f"cannot read the grammar: {e}") from None


class Grammars:
    """Compiled guides for one tokenizer; `matcher(guide)` is a fresh matcher for one
    request, or a GuideError naming the field."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_string: int | None = None):
        import llguidance.hf

        self.max_string = max_string  # the model's `guided_max_string` (None: unbounded)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self._templates: OrderedDict[Guide, Any] = OrderedDict()
        self._lock = threading.Lock()  # the API checks a guide while the engine steps

    def matcher(self, guide: Guide) -> Any:
        """A fresh matcher for one request: a copy of the cached compiled template."""
        return self.template(guide).deep_copy()

    def template(self, guide: Guide) -> Any:
        """The guide compiled, once per guide (a GuideError for one that cannot be)."""
        with self._lock:
            template = self._templates.get(guide)
        if template is None:
            template = self._compile(guide)
        with self._lock:
            self._templates[guide] = template
            self._templates.move_to_end(guide)
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        return template

    def _compile(self, guide: Guide) -> Any:
        from llguidance import LLMatcher

        grammar = grammar_text(guide, self.max_string)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GuideError(guide.field, error.strip().splitlines()[0][:300])
        matcher = LLMatcher(self.tokenizer, grammar)
        self._probe(guide, matcher)
        return matcher

    def _probe(self, guide: Guide, matcher: Any) -> None:
        """Take the grammar's first step on a copy: llguidance meets its own limits
        (parser items, lexer size) only when it consumes a token, and a guide that does
        is the caller's to fix (400), not a request failing inside a step (500)."""
        probe = matcher.deep_copy()
        if not probe.is_error():
            allowed = unpack(mask_rows([probe], self.vocab_size), self.vocab_size)[0]
            first = allowed.nonzero()
            if len(first):
                probe.consume_token(int(first[0]))
        if probe.is_error():
            raise GuideError(guide.field, probe.get_error().strip().splitlines()[0][:300])


def mask_rows(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask of each matcher's next token ([rows, words] int32)."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        fill_next_token_bitmask(matcher, bitmask, row)
    return bitmask


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def shifts(device: torch.device) -> torch.Tensor:
    """0..31 as int32 on `device` (made once per device)."""
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _SHIFTS[device]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: bit t % 32 of word t // 32 allows
    token t."""
    bits = (bitmask.unsqueeze(-1) >> shifts(bitmask.device)) & 1
    return bits.bool().flatten(1)[:, :vocab_size]


@torch.inference_mode()
def apply_masks(
    logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, picks: list[int] | None = None
) -> None:
    """Refused tokens of logits `rows` to -inf, in place (the logits are inference
    tensors), by bitmask rows `picks` (default: the bitmask's rows in order). Everything
    happens on the logits' device: the bitmask goes there in one copy (without waiting
    from llguidance's pinned buffer on cuda), then is unpacked with two tensor ops
    (llguidance's own helper goes through torch.compile's wrapper, which cost more than
    the work)."""
    device = logits.device
    bitmask = bitmask.to(device, non_blocking=bitmask.is_pinned())
    index = torch.tensor(rows + (picks or []), dtype=torch.long)
    if device.type == "cuda":  # a copy from pageable memory would wait for the device
        index = index.pin_memory()
    index = index.to(device, non_blocking=True)
    if picks is not None and picks != list(range(bitmask.shape[0])):
        bitmask = bitmask.index_select(0, index[len(rows) :])
    index = index[: len(rows)]
    allowed = unpack(bitmask, logits.shape[-1])
    picked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, picked)
