"""Triton's generate extension for LLM models.

`POST /v2/models/{m}/generate` takes `{"text_input": ..., "parameters": {...}}` and
answers `{"model_name", "model_version", "text_output"}`; `.../generate_stream` sends
the same as server-sent events, one per new piece of text, and an error that comes after
the headers as a last `{"error": ...}` event. Sampling parameters are the engine's
(`max_tokens`, `temperature`, ...), checked strictly (backends/llm.py `sampling`).
Plain v2 infer on an llm model goes the one request path (`ModelVersion.start`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bitserve.backends.llm import EngineRequest, LLMService, sampling
from bitserve.inference import InvalidRequest
from bitserve.repository.version import ModelVersion
from bitserve.server.errors import handle
from bitserve.server.http import json_object, pinned_version
from bitserve.server.state import ServerState


def routes(state: ServerState) -> list[Route]:
    async def body(request: Request) -> tuple[ModelVersion, LLMService, EngineRequest]:
        doc = json_object(await request.body())
        model = request.path_params["model"]
        await state.repository.ensure_loaded(model)
        # looked up after the last await (see v2.infer); a traffic policy's canary split
        # applies (bitserve/rollout), its statistics count v2 infer only
        version, _ = state.route_model(model, pinned_version(request))
        llm = version.serving("generate")  # NotSupported: a 400 naming the model
        if not isinstance(doc.get("text_input"), str):
            raise InvalidRequest("field 'text_input' must be a string")
        parameters = doc.get("parameters")
        params = sampling({} if parameters is None else parameters)
        return version, llm, llm.process([doc["text_input"]], [params])[0]

    async def generate(request: Request) -> Response:
        version, llm, admitted = await body(request)
        lease = version.begin()
        try:
            text = await llm.complete(admitted)
        finally:
            lease.release()
        return Response(orjson.dumps(_doc(version, text)), media_type="application/json")

    async def generate_stream(request: Request) -> Response:
        # checked and admitted by the front door already: a 4xx/503 now, not a stream
        # that starts and breaks
        version, llm, admitted = await body(request)
        lease = version.begin()  # no await since the lookup: a drain cannot miss it

        async def events() -> AsyncIterator[bytes]:
            try:
                async for out in llm.generate(admitted):
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
        routes.append(Route(prefix + "/generate", handle(generate), methods=["POST"]))
        routes.append(Route(prefix + "/generate_stream", handle(generate_stream), methods=["POST"]))
    return routes


def _doc(version: ModelVersion, text: str) -> dict:
    return {
        "model_name": version.config.name,
        "model_version": str(version.version),
        "text_output": text,
    }
