"""The v2 protocol's routes: server and model metadata, model readiness, config and
statistics, infer, and the rollout report. The wire format is bitserve/api/v2.py's (the
codec it shares with gRPC).

Infer reads the body (capped, gzip/deflate), picks the version (a pinned one, or the
traffic policy's), parses the request against the model's config, and hands it to the
version (`ModelVersion.start`): a batched model or an LLM alike. A client that
disconnects while its request is still queued takes it out of the queue.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve import __version__
from bitserve.api import classification
from bitserve.api.v2 import (
    HEADER_LENGTH,
    encode_response,
    model_metadata,
    model_stats,
    parse_infer,
)
from bitserve.inference import ClientGone, InvalidRequest
from bitserve.repository.paths import tasks_of
from bitserve.repository.repository import ModelNotFound, ModelUnavailable
from bitserve.repository.version import ModelVersion
from bitserve.server.errors import BodyTooLarge, handle
from bitserve.server.http import json_response, pinned_version, until_disconnect
from bitserve.server.record import recorded
from bitserve.server.state import ServerState

EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "system_shared_memory",
]


def routes(state: ServerState) -> list[Route]:
    v2 = V2(state)
    m, mv = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    found = [
        # infer first: the router tries routes in order
        Route(m + "/infer", handle(v2.infer), methods=["POST"]),
        Route(mv + "/infer", handle(v2.infer), methods=["POST"]),
        Route("/v2", v2.server_metadata),
        Route("/openapi.json", v2.openapi),
        Route("/v2/models/stats", handle(v2.model_stats)),
        Route(m + "/rollout", handle(v2.rollout_report)),
    ]
    for prefix in (m, mv):
        found += [
            Route(prefix, handle(v2.model_metadata)),
            Route(prefix + "/ready", v2.model_ready),
            Route(prefix + "/config", handle(v2.model_config)),
            Route(prefix + "/stats", handle(v2.model_stats)),
        ]
    return found


class V2:
    def __init__(self, state: ServerState):
        self.state = state
        self.repository = state.repository

    # -------------------------------------------------------------- metadata

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "bitserve", "version": __version__, "extensions": EXTENSIONS})

    async def openapi(self, request: Request) -> Response:
        from bitserve.server.openapi import document

        models = self.repository.models.items()
        tasks = {n: tasks_of(e.config.backend, e.config.parameters) for n, e in models if e.config}
        return json_response(document(tasks))

    def _lookup(self, request: Request) -> ModelVersion:
        params = request.path_params
        return self.repository.get(params["model"], params.get("version"))

    async def model_ready(self, request: Request) -> Response:
        try:
            self._lookup(request)
        except ModelNotFound:
            return Response(status_code=404)
        except ModelUnavailable:
            return Response(status_code=503)
        return Response(status_code=503 if self.state.draining else 200)

    async def model_metadata(self, request: Request) -> Response:
        version = self._lookup(request)
        entry = self.repository.entry(version.config.name)
        return json_response(model_metadata(version, entry))

    async def model_config(self, request: Request) -> Response:
        return json_response(self._lookup(request).config.model_dump(mode="json"))

    async def model_stats(self, request: Request) -> Response:
        stats = model_stats(self.repository, request.path_params.get("model"))
        return json_response({"model_stats": stats})

    async def rollout_report(self, request: Request) -> Response:
        """The canary and shadow verdict (`bitserve rollout report`)."""
        entry = self.repository.entry(request.path_params["model"])
        rollout = self.state.rollout.get(entry)
        if rollout is None:
            raise ModelNotFound(f"model '{entry.name}' has no traffic policy")
        from bitserve.rollout import verdict

        # bootstraps and scipy's import take tens of ms: off the loop, on a copy
        return json_response(await asyncio.to_thread(verdict.report, rollout.snapshot()))

    # ----------------------------------------------------------------- infer

    async def infer(self, request: Request) -> Response:
        self.state.enter()
        try:
            body = await self._read_body(request)
            model = request.path_params["model"]
            await self.repository.ensure_loaded(model)
            # Choose the version only now: from here to its queue nothing awaits, so a
            # version swapped out meanwhile cannot be drained between the two.
            version, route = self.state.route_model(model, pinned_version(request))
            return await self._infer(request, version, body, route)
        finally:
            self.state.leave()

    async def _infer(
        self, http: Request, version: ModelVersion, body: bytes, route: Any
    ) -> Response:
        with recorded(self.state, version, route) as record:
            header_length = http.headers.get(HEADER_LENGTH)
            if header_length is not None and not header_length.isdigit():
                raise InvalidRequest("header Inference-Header-Content-Length must be an integer")
            length = int(header_length) if header_length is not None else None
            record.parsed = parse_infer(version.config, body, length, self.state.shm)
            ticket = version.start(record.parsed)
            record.job = ticket.job
            gone = ClientGone("client disconnected")
            outputs = await until_disconnect(http, ticket.result, lambda: ticket.cancel(gone))
            record.outputs = outputs
            answer = classification.apply(version, record.parsed, outputs)
            payload, json_length = encode_response(
                version.config.name, version.version, record.parsed, answer, self.state.shm
            )
        if json_length is None:
            return Response(payload, media_type="application/json")
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(json_length)},
        )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.state.options.max_body
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BodyTooLarge(f"request body of {length} bytes exceeds {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "").lower()
        if encoding in ("gzip", "deflate"):
            body = _decompress(body, encoding, limit)
        elif encoding not in ("", "identity"):
            raise InvalidRequest(f"unsupported Content-Encoding {encoding!r}")
        return body


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise InvalidRequest(f"body is not valid {encoding} data: {e}") from None
    if len(out) > limit:
        raise BodyTooLarge(f"decompressed request body exceeds {limit} bytes")
    return out
