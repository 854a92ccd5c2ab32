"""Structured outputs with the openai SDK against tinylm, a model that knows nothing of
JSON: for 200 generated JSON schemas (nested objects, bounded arrays, enums, patterns,
required and optional keys, number ranges) every output parses and validates with
jsonschema; pydantic parsing, guided_choice, guided_regex and guided_grammar hold; bad
guides are 400s naming the param, and the server stays live."""

from __future__ import annotations

import json
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import ROOT, Server

SCHEMAS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("structured") / "models"
    shutil.copytree(ROOT / "models" / "tinylm", repo / "tinylm")
    server = Server(repo)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def scalar(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "pattern", "null"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "ark", "dove", "lamb"], 3)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^[A-Z][0-9]{2}$"])}
    return {"type": kind}


def schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema that fits tinylm's 256-token context once filled in: up to
    two levels of nesting, arrays of at most 4 scalars or 2 flat objects, 3 keys each."""
    properties = {}
    for i in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            properties[f"obj{i}"] = schema(rng, depth + 1)
        elif roll < 0.4:
            flat = depth or rng.random() < 0.7
            low = rng.randint(0, 2 if flat else 1)
            properties[f"list{i}"] = {
                "type": "array",
                "items": scalar(rng) if flat else schema(rng, 2),
                "minItems": low,
                "maxItems": low + rng.randint(0, 2 if flat else 1),
            }
        else:
            properties[f"f{i}"] = scalar(rng)
    required = [k for k in properties if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def test_generated_schemas_always_give_valid_json(client):
    rng = random.Random(20261201)
    schemas = [schema(rng) for _ in range(SCHEMAS)]

    def ask(i: int) -> tuple[dict, str, str]:
        reply = client.chat.completions.create(
            model="tinylm",
            messages=[{"role": "user", "content": "Describe the ark."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True},
            },
            max_tokens=200,
            temperature=1.0,
            seed=i,
        )
        choice = reply.choices[0]
        return schemas[i], choice.message.content, choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(SCHEMAS)))
    for spec, text, finish in results:
        assert finish == "stop", (spec, text)
        jsonschema.validate(json.loads(text), spec)


class Verse(BaseModel):
    book: str = Field(max_length=20)
    chapter: int = Field(ge=1, le=150)
    blessed: bool


def test_pydantic_parse(client):
    reply = client.beta.chat.completions.parse(
        model="tinylm",
        messages=[{"role": "user", "content": "Which verse?"}],
        response_format=Verse,
        max_tokens=100,
    )
    verse = reply.choices[0].message.parsed
    assert isinstance(verse, Verse) and 1 <= verse.chapter <= 150


def test_json_object_mode(client):
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tinylm",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_object"},
            max_tokens=200,
            seed=seed,
        )
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def _guided(client, seed: int, **extra) -> str:
    reply = client.completions.create(
        model="tinylm", prompt="Answer:", max_tokens=30, seed=seed, extra_body=extra
    )
    return reply.choices[0].text


def test_guided_choice_regex_and_grammar(client):
    choices = ["Moses", "Aaron", "Miriam"]
    pattern = r"[A-Z][a-z]{1,6} [0-9]{1,3}:[0-9]{1,3}"
    grammar = 'root ::= "amen" | "selah" | [0-9] [0-9]'
    for seed in range(6):
        assert _guided(client, seed, guided_choice=choices) in choices
        text = _guided(client, seed, guided_regex=pattern)
        assert re.fullmatch(pattern, text), text
        text = _guided(client, seed, guided_grammar=grammar)
        assert text in ("amen", "selah") or re.fullmatch(r"[0-9]{2}", text), text


def test_streamed_json_reassembles(client):
    spec = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    stream = client.chat.completions.create(
        model="tinylm",
        messages=[{"role": "user", "content": "?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": spec}},
        max_tokens=50,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), spec)


RECURSIVE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "wat"}},
            }
        },
        "response_format",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": r"(?<=a)b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": 'root ::= "a" | missing'}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    # past llguidance's own limits at the first token (parser items, lexer size)
    ({"guided_json": {"$defs": {"n": RECURSIVE}, "$ref": "#/$defs/n"}}, "guided_json"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    (
        {"guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(5000))},
        "guided_grammar",
    ),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_guides_are_400_naming_the_param(server, fields, param):
    body = {"model": "tinylm", "prompt": "x", "max_tokens": 4, **fields}
    for stream in (False, True):
        answer = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


def test_v2_generate_takes_guided_parameters(server):
    answer = httpx.post(
        server.url + "/v2/models/tinylm/generate",
        json={"text_input": "Yea or nay?", "parameters": {"guided_choice": ["yea", "nay"]}},
    )
    assert answer.status_code == 200 and answer.json()["text_output"] in ("yea", "nay")
    answer = httpx.post(
        server.url + "/v2/models/tinylm/generate",
        json={"text_input": "x", "parameters": {"guided_regex": "(a"}},
    )
    assert answer.status_code == 400 and "guided_regex" in answer.json()["error"]


# ------------------------------------------------------------------ tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
PSALM = {
    "type": "function",
    "function": {
        "name": "psalm",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 150}},
            "required": ["n"],
        },
    },
}
TOOLS = [WEATHER, PSALM]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Ur?"}]
SHORT = {"few_shot": False}  # tinylm's 256-token context: no system prompt


def _call(client, choice, seed, stream=False):
    return client.chat.completions.create(
        model="tinylm",
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=60,
        seed=seed,
        stream=stream,
        extra_body=SHORT,
    )


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "psalm"}}]
)
def test_forced_tool_calls_always_have_valid_arguments(client, choice):
    for seed in range(5):
        reply = _call(client, choice, seed).choices[0]
        assert reply.finish_reason == "tool_calls"
        (call,) = reply.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "psalm"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_streamed_tool_call_reassembles_into_the_plain_one(client):
    for seed in range(3):
        plain = _call(client, "required", seed).choices[0].message.tool_calls[0]
        name, arguments, finish = None, "", None
        for chunk in _call(client, "required", seed, stream=True):
            if not chunk.choices:
                continue
            for delta in chunk.choices[0].delta.tool_calls or []:
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (name, arguments, finish) == (
            plain.function.name,
            plain.function.arguments,
            "tool_calls",
        )


def test_tool_results_in_the_history_and_auto(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Ur"}'},
    }
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    reply = client.chat.completions.create(
        model="tinylm", messages=history, tools=TOOLS, max_tokens=10, extra_body=SHORT
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.mark.parametrize("fields, param", BAD_TOOLS)
def test_bad_tools_are_400_naming_the_param(server, fields, param):
    body = {"model": "tinylm", "messages": ASK, "max_tokens": 4, **fields}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
