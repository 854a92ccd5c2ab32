"""Tool calls: the model's own call syntax, parsed back into OpenAI's `tool_calls`, and
the grammar that makes `tool_choice="required"` or a named function always produce a
call whose arguments validate against the function's parameters.

A model's syntax is chosen in its config (`tool_parser`): Hermes/Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3
`{"name": ..., "parameters": {...}}`, or Mistral
`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`. The arguments a call carries are the
model's own text (compact JSON under a grammar), so a streamed call's argument deltas
reassemble into exactly the non-streamed call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from bitserve.llm.structured import COMPACT, Guide, bounded

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Syntax:
    opening: str  # text before a call's JSON
    closing: str  # text after it
    arguments_key: str  # "arguments" or "parameters"
    as_list: bool = False  # Mistral wraps the calls in one JSON list


SYNTAXES = {
    "hermes": Syntax("<tool_call>", "</tool_call>", "arguments"),
    "llama3_json": Syntax("", "", "parameters"),
    "mistral": Syntax("[TOOL_CALLS]", "", "arguments", as_list=True),
}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def instructions(tools: list[dict], parser: str) -> str:
    """A system prompt that lists the tools, for chat templates that take no `tools`."""
    syntax = SYNTAXES[parser]
    example = f'{{"name": NAME, "{syntax.arguments_key}": ARGS}}'
    if syntax.as_list:
        example = f"[{example}]"
    listing = "\n".join(signature(t["function"]) for t in tools)
    return f"Functions:\n{listing}\nCall: {syntax.opening}{example}{syntax.closing}"


def signature(function: dict) -> str:
    """`name(arg: type, optional?: type) - description`: short, for small contexts."""
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required", []))
    args = [
        f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
        for name, spec in parameters.get("properties", {}).items()
    ]
    described = f" - {function['description']}" if function.get("description") else ""
    return f"{function['name']}({', '.join(args)}){described}"


def call_text(name: str, arguments: str, parser: str) -> str:
    """A past call as the model writes it (assistant turns that carry tool_calls)."""
    syntax = SYNTAXES[parser]
    body = f'{{"name": {json.dumps(name)}, "{syntax.arguments_key}": {arguments}}}'
    return syntax.opening + (f"[{body}]" if syntax.as_list else body) + syntax.closing


def guide(tools: list[dict], only: str | None, parser: str, max_string: int | None) -> Guide:
    """A grammar admitting exactly one call of one of `tools` (or of `only`), with
    arguments valid for that function's parameters."""
    syntax = SYNTAXES[parser]
    options = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        if max_string is not None:
            parameters = bounded(parameters, max_string)
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    syntax.arguments_key: parameters,
                },
                "required": ["name", syntax.arguments_key],
                "additionalProperties": False,
            }
        )
    call: dict = options[0] if len(options) == 1 else {"anyOf": options}
    if syntax.as_list:
        call = {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
    compact = {"x-guidance": COMPACT}
    lark = (
        f"start: {json.dumps(syntax.opening) + ' ' if syntax.opening else ''}call"
        f"{' ' + json.dumps(syntax.closing) if syntax.closing else ''}\n"
        f"call: %json {json.dumps({**call, **compact})}\n"
    )
    return Guide("lark", lark, "tool_choice")


def parse(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(the text before any call, the calls) of a finished output."""
    syntax = SYNTAXES[parser]
    calls: list[ToolCall] = []
    start = _call_start(text, syntax)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    position = start
    while position >= 0 and position < len(text):
        found = _read_call(text, position, syntax)
        if found is None:
            break
        new_calls, end = found
        calls += new_calls
        position = text.find(syntax.opening, end) if syntax.opening else -1
    if not calls:
        return text, []
    return content, calls


def _call_start(text: str, syntax: Syntax) -> int:
    """Where the first call starts (-1: none yet): its opening text, or for Llama 3's
    bare JSON an output that begins with "{"."""
    return text.find(syntax.opening) if syntax.opening else _first_brace(text)


def _first_brace(text: str) -> int:
    stripped = text.lstrip()
    return len(text) - len(stripped) if stripped.startswith("{") else -1


def _read_call(text: str, position: int, syntax: Syntax) -> tuple[list[ToolCall], int] | None:
    at = position + len(syntax.opening)
    try:
        value, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    items = value if syntax.as_list and isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if syntax.arguments_key not in item:
            return None
        calls.append(ToolCall(item["name"], _raw_arguments(text, at, end, syntax, item)))
    if syntax.closing and text.startswith(syntax.closing, end):
        end += len(syntax.closing)
    return calls, end


def _raw_arguments(text: str, start: int, end: int, syntax: Syntax, item: dict) -> str:
    """The arguments object as written, when it can be found; else re-serialised."""
    key = f'"{syntax.arguments_key}":'
    at = text.find(key, start, end)
    if at >= 0 and not syntax.as_list:
        at += len(key)
        while at < end and text[at] == " ":
            at += 1
        try:
            _, stop = _DECODER.raw_decode(text, at)
            return text[at:stop]
        except ValueError:
            pass
    return json.dumps(item[syntax.arguments_key])


class ToolStream:
    """Streams one choice's text as OpenAI deltas: content until a call starts, then
    the call's name once known and its arguments as they grow (held back by the
    length of what may close them, so the deltas reassemble into the final call)."""

    def __init__(self, parser: str):
        self.syntax = SYNTAXES[parser]
        self.text = ""
        self.sent_content = 0
        self.call: dict | None = None  # {"id", "name", "args_at", "sent"}
        self.index = -1

    def feed(self, delta: str, finished: bool) -> list[dict]:
        """The OpenAI `delta` dicts for this new text."""
        self.text += delta
        out: list[dict] = []
        start = _call_start(self.text, self.syntax)
        if start < 0 and not finished:
            hold = len(self.syntax.opening)  # a marker may be arriving
            content = self.text[self.sent_content : max(self.sent_content, len(self.text) - hold)]
        elif start < 0:
            content = self.text[self.sent_content :]
        else:
            content = self.text[self.sent_content : start].rstrip() if self.call is None else ""
        if content:
            out.append({"content": content})
        self.sent_content = (
            self.sent_content + len(content) if start < 0 else max(self.sent_content, start)
        )
        if start >= 0:
            out += self._call_deltas(start, finished)
        return out

    def _call_deltas(self, start: int, finished: bool) -> list[dict]:
        out = []
        if self.call is None:
            head = self.text[start:]
            marker = f'"{self.syntax.arguments_key}":'
            if '"name": "' not in head or marker not in head:
                return out
            name_at = head.index('"name": "') + len('"name": "')
            name_end = head.find('"', name_at)
            if name_end < 0 or head.index(marker) < name_end:
                return out
            args_at = start + head.index(marker) + len(marker)
            while args_at < len(self.text) and self.text[args_at] == " ":
                args_at += 1
            if args_at == len(self.text):  # where the arguments start is not known yet
                return out
            self.index += 1
            self.call = {"id": "call_" + uuid.uuid4().hex[:24], "args_at": args_at, "sent": args_at}
            function = {"name": head[name_at:name_end], "arguments": ""}
            out.append(
                self._delta({"id": self.call["id"], "type": "function", "function": function})
            )
        end = self._arguments_end()
        limit = end if end is not None else len(self.text) - len(self.syntax.closing) - 2
        if finished and end is None:
            limit = len(self.text)
        if limit > self.call["sent"]:
            chunk = self.text[self.call["sent"] : limit]
            self.call["sent"] = limit
            out.append(self._delta({"function": {"arguments": chunk}}))
        return out

    def _arguments_end(self) -> int | None:
        try:
            _, stop = _DECODER.raw_decode(self.text, self.call["args_at"])
        except ValueError:
            return None
        return stop

    def _delta(self, call: dict) -> dict:
        return {"tool_calls": [{"index": self.index, **call}]}
