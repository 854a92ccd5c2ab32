"""A request body that must be one JSON object, read as Triton reads it (NaN included):
for every protocol that takes JSON, and for batch files."""

from __future__ import annotations

import json
from typing import Any

import orjson

from bitserve.inference import InvalidRequest


def json_object(body: bytes) -> dict:
    """A request body that must be one JSON object (400 otherwise).

    `NaN`, `Infinity` and `-Infinity` are read as floats, as Triton's parser does
    (rapidjson's kParseNanAndInfFlag) and as Python's json and tritonclient.http write
    them; strict JSON has no such tokens, so only a body orjson refuses is read again."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        doc = _with_nan(body, e)
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object")
    return doc


def _with_nan(body: bytes, error: orjson.JSONDecodeError) -> Any:
    """`body` read with NaN and the infinities allowed, else `error` as a 400."""
    if b"NaN" not in body and b"Infinity" not in body:
        raise InvalidRequest(f"malformed JSON in request body: {error}") from None
    try:
        doc = json.loads(body)
        orjson.dumps(doc)  # what orjson would have refused besides: lone surrogates, huge ints
    except (ValueError, TypeError, RecursionError):  # (Unicode errors are ValueErrors)
        raise InvalidRequest(f"malformed JSON in request body: {error}") from None
    return doc
