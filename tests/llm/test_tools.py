"""Tool-call syntaxes parsed back into calls, and streamed deltas that reassemble into
exactly the parsed call, for each parser a model's config can name."""

from __future__ import annotations

import json

import pytest

from bitserve.llm.tools import SYNTAXES, ToolStream, call_text, parse

ARGS = '{"city": "Ur", "days": [1, 2], "note": "a } in text"}'


@pytest.mark.parametrize("parser", sorted(SYNTAXES))
def test_a_call_round_trips(parser):
    text = "Let me look. " + call_text("weather", ARGS, parser)
    if parser == "llama3_json":  # a bare JSON object: nothing may precede it
        text = call_text("weather", ARGS, parser)
    content, calls = parse(text, parser)
    assert [(c.name, c.arguments) for c in calls] == [("weather", ARGS)]
    assert content == (None if parser == "llama3_json" else "Let me look.")


def test_several_hermes_calls_and_plain_text():
    text = call_text("a", "{}", "hermes") + "\n" + call_text("b", '{"x": 1}', "hermes")
    _, calls = parse(text, "hermes")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"x": 1})]
    assert parse("no call here", "hermes") == ("no call here", [])
    assert parse("<tool_call>{broken", "hermes") == ("<tool_call>{broken", [])


@pytest.mark.parametrize("parser", sorted(SYNTAXES))
@pytest.mark.parametrize("step", [1, 2, 5, 11])
def test_streamed_deltas_reassemble(parser, step):
    prefix = "" if parser == "llama3_json" else "Sure. "
    text = prefix + call_text("weather", ARGS, parser)
    stream, deltas = ToolStream(parser), []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step], i + step >= len(text))
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == prefix.strip()
    assert calls[0]["function"]["name"] == "weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"].get("arguments", "") for c in calls) == ARGS
