"""The v2 protocol for LLM models: Triton's generate extension and plain infer.

`POST /v2/models/{m}/generate` takes `{"text_input": ..., "parameters": {...}}` and
answers `{"model_name", "model_version", "text_output"}`; `.../generate_stream` sends
the same as server-sent events, one per new piece of text. `infer` on an llm model takes
`text_input` (BYTES) and an optional JSON `sampling_parameters`, as Triton's vLLM
backend does. Sampling parameters are the engine's (`max_tokens`, `temperature`, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bitserve.llm.sampling_params import SamplingError, SamplingParams
from bitserve.repository.version import ModelVersion
from bitserve.server.v2 import InvalidRequest

if TYPE_CHECKING:
    from bitserve.server.app import Server

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling(parameters: Any) -> SamplingParams:
    """The engine's sampling parameters from a JSON object, strictly (sampling_params)."""
    if not isinstance(parameters, dict):
        raise InvalidRequest("'parameters' must be a JSON object")
    unknown = set(parameters) - FIELDS - {"stream"}
    if unknown:
        raise InvalidRequest(f"unknown sampling parameters {sorted(unknown)}")
    if "stream" in parameters and not isinstance(parameters["stream"], bool):
        raise InvalidRequest("parameters.stream: must be a bool")
    try:
        return SamplingParams(**{k: v for k, v in parameters.items() if k in FIELDS})
    except SamplingError as e:
        raise InvalidRequest(f"parameters.{e}") from None


async def _text(version: ModelVersion, prompt: str, params: SamplingParams) -> str:
    assert version.llm is not None
    lease = version.begin()
    try:
        text = ""
        async for out in version.llm.generate(prompt, params):
            text = out.outputs[0].text
        return text
    finally:
        lease.release()


async def infer(http: Request, version: ModelVersion, inputs: dict) -> dict:
    """v2 infer on an llm model: text_input (+ sampling_parameters) -> text_output."""
    prompt = _one(inputs["text_input"], "text_input")
    raw = inputs.get("sampling_parameters")
    params = sampling(_json(_one(raw, "sampling_parameters")) if raw is not None else {})
    text = await _text(version, prompt, params)
    out = np.empty(1, dtype=object)
    out[0] = text.encode()
    return {"text_output": out}


def _json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"input 'sampling_parameters' is not JSON: {e}") from None


def _one(array: np.ndarray, name: str) -> str:
    if array.size != 1:
        raise InvalidRequest(f"input '{name}' takes one element")
    item = array.reshape(-1)[0]
    try:
        return item.decode() if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' is not UTF-8") from None


def routes(server: Server, errors: Any) -> list[Route]:
    async def body(request: Request) -> tuple[ModelVersion, str, SamplingParams]:
        try:
            doc = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise InvalidRequest(f"malformed JSON: {e}") from None
        await server.repository.ensure_loaded(request.path_params["model"])
        # looked up after the last await: see Server.infer; a traffic policy's canary
        # split applies (bitserve/rollout), its statistics count v2 infer only
        version, _ = server.route(request)
        if version.llm is None:
            raise InvalidRequest(f"model '{version.config.name}' does not generate text")
        if not isinstance(doc, dict) or not isinstance(doc.get("text_input"), str):
            raise InvalidRequest("field 'text_input' must be a string")
        parameters = doc.get("parameters")
        return version, doc["text_input"], sampling({} if parameters is None else parameters)

    async def generate(request: Request) -> Response:
        version, prompt, params = await body(request)
        text = await _text(version, prompt, params)
        return Response(orjson.dumps(_doc(version, text)), media_type="application/json")

    async def generate_stream(request: Request) -> Response:
        version, prompt, params = await body(request)
        assert version.llm is not None
        version.llm.check_serving()  # a 503 now, not a stream that starts and breaks
        version.llm.check_length(version.llm.encode(prompt), params.max_tokens)
        lease = version.begin()  # no await since the lookup: a drain cannot miss it

        async def events() -> AsyncIterator[bytes]:
            try:
                async for out in version.llm.generate(prompt, params):
                    delta = out.outputs[0].delta_text
                    if delta or out.finished:
                        doc = _doc(version, delta)
                        doc["finish_reason"] = out.outputs[0].finish_reason
                        yield b"data: " + orjson.dumps(doc) + b"\n\n"
            except Exception as e:  # the headers are gone: the error is the last event
                yield b"data: " + orjson.dumps({"error": str(e) or type(e).__name__}) + b"\n\n"
            finally:
                lease.release()

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = []
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes.append(Route(prefix + "/generate", errors(generate), methods=["POST"]))
        routes.append(Route(prefix + "/generate_stream", errors(generate_stream), methods=["POST"]))
    return routes


def _doc(version: ModelVersion, text: str) -> dict:
    return {
        "model_name": version.config.name,
        "model_version": str(version.version),
        "text_output": text,
    }
