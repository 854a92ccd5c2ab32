"""Triton's generate extension for LLM models, and the v2 token stream it shares with gRPC.

`POST /v2/models/{m}/generate` takes `{"text_input": ..., "parameters": {...}}` and
answers `{"model_name", "model_version", "text_output"}`; `.../generate_stream` sends
the same as server-sent events, one per new piece of text, and an error that comes after
the headers as a last `{"error": ...}` event. Sampling parameters are the engine's
(`max_tokens`, `temperature`, ...), checked strictly (backends/llm.py `sampling`).
Plain v2 infer on an llm model goes the one request path (`ModelVersion.start`).

`text_stream` is the LLM token stream over v2, written once: generate_stream encodes its
pieces as server-sent events here, ModelStreamInfer as gRPC stream responses
(grpc_server.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bitserve import tracing
from bitserve.api.jsonbody import json_object
from bitserve.backends.llm import EngineRequest, LLMService, sampling
from bitserve.inference import InvalidRequest
from bitserve.repository.version import Lease, ModelVersion
from bitserve.server.errors import handle
from bitserve.server.http import pinned_version
from bitserve.server.state import ServerState

# one piece of a text stream: the new text and, on the last piece, why it finished
Piece = tuple[str, str | None]


def admit(version: ModelVersion, text: Any, parameters: Any) -> tuple[LLMService, EngineRequest]:
    """A v2 text request through the LLM front door: encoded, checked against the one set
    of limits and admitted (a 4xx or 503 before a wire sends anything)."""
    llm = version.serving("generate")  # NotSupported: a 400 naming the model
    if not isinstance(text, str):
        raise InvalidRequest("field 'text_input' must be a string")
    params = sampling({} if parameters is None else parameters)
    return llm, llm.process([text], [params])[0]


def text_stream(version: ModelVersion, text: Any, parameters: Any) -> AsyncIterator[Piece]:
    """The generation of `text`, piece by piece: admitted now, generated as it is
    iterated. Every piece has new text but the last, which has its finish reason.
    Closing it early stops the generation and frees its KV blocks."""
    llm, admitted = admit(version, text, parameters)
    lease = version.begin()  # no await since the caller's lookup: a drain cannot miss it
    return _pieces(llm, admitted, lease, version.config.name)


async def _pieces(
    llm: LLMService, admitted: EngineRequest, lease: Lease, model: str
) -> AsyncIterator[Piece]:
    try:
        outputs = tracing.generation(model, llm.generate(admitted))
        async with contextlib.aclosing(outputs) as outs:
            async for out in outs:
                delta = out.outputs[0].delta_text
                if delta or out.finished:
                    yield delta, out.outputs[0].finish_reason
    finally:
        lease.release()


def routes(state: ServerState) -> list[Route]:
    async def body(request: Request) -> tuple[ModelVersion, dict]:
        doc = json_object(await request.body())
        model = request.path_params["model"]
        await state.repository.ensure_loaded(model)
        # looked up after the last await (see v2.infer); a traffic policy's canary split
        # applies (bitserve/rollout), its statistics count v2 infer only
        version, _ = state.route_model(model, pinned_version(request))
        return version, doc

    async def generate(request: Request) -> Response:
        version, doc = await body(request)
        llm, admitted = admit(version, doc.get("text_input"), doc.get("parameters"))
        lease = version.begin()
        try:
            text = await llm.complete(admitted)
        finally:
            lease.release()
        return Response(orjson.dumps(_doc(version, text)), media_type="application/json")

    async def generate_stream(request: Request) -> Response:
        version, doc = await body(request)
        pieces = text_stream(version, doc.get("text_input"), doc.get("parameters"))

        async def events() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(pieces):  # a client gone stops the generation
                try:
                    async for delta, finish_reason in pieces:
                        doc = _doc(version, delta)
                        doc["finish_reason"] = finish_reason
                        yield b"data: " + orjson.dumps(doc) + b"\n\n"
                except Exception as e:  # the headers are gone: the error is the last event
                    error = {"error": str(e) or type(e).__name__}
                    yield b"data: " + orjson.dumps(error) + b"\n\n"

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
