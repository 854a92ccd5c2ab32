"""The sampling parameters' published JSON Schema: `SamplingParams`' fields with the
ranges of its own `LIMITS`. Every door publishes these (v2 generate's `parameters`,
the OpenAI bodies' sampling fields) and none checks them itself: the one check is
`SamplingParams` (built by `backends.llm.sampling`), so an out-of-range value gets one
message, naming the field, whichever door it came through.
"""

from __future__ import annotations

import functools

from pydantic import TypeAdapter

from bitserve.llm.sampling_params import LIMITS, OPEN_BELOW, SamplingParams


@functools.cache
def schema() -> dict:
    """SamplingParams as JSON Schema, each field with its range from LIMITS."""
    doc = TypeAdapter(SamplingParams).json_schema()
    doc["additionalProperties"] = False
    doc["properties"]["stream"] = {"type": "boolean"}  # generate accepts it, ignored
    for name, (low, high) in LIMITS.items():
        prop = doc["properties"][name]
        target = next((o for o in prop.get("anyOf", [prop]) if o.get("type") != "null"), prop)
        target["exclusiveMinimum" if name in OPEN_BELOW else "minimum"] = low
        target["maximum"] = high
    return doc


def field_schema(name: str) -> dict:
    """One field's schema, without its null option or default (the body states its own)."""
    prop = dict(schema()["properties"][name])
    prop.pop("default", None)
    prop.pop("title", None)
    options = [o for o in prop.get("anyOf", []) if o.get("type") != "null"]
    return options[0] if len(options) == 1 else prop
