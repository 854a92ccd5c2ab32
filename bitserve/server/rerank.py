"""Rerank and score routes over hf cross-encoders; the wire formats, limits and bodies
are in bitserve/api/rerank.py.

`POST /v1/rerank` (and `/rerank`, `/v2/rerank`, as vLLM serves them) and `POST /v1/score`
(and `/score`). A request's pairs are queued on the model's dynamic batcher all at once,
as v2 requests of at most max_batch_size rows; a client that disconnects takes back
what has not started. Errors use OpenAI's shape, with `param` naming the field.
"""

from __future__ import annotations

import asyncio

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.api.openai import parse
from bitserve.api.rerank import (
    RerankRequest,
    ScoreRequest,
    one_score_each,
    pair_requests,
    rerank_body,
    rerank_pairs,
    score_body,
    score_pairs,
    token_counts,
)
from bitserve.inference import ClientGone
from bitserve.repository.version import ModelVersion
from bitserve.server.errors import handle
from bitserve.server.http import until_disconnect
from bitserve.server.state import ServerState

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")


def routes(state: ServerState) -> list[Route]:
    api = Rerank(state)
    rerank = handle(api.rerank, "openai")
    score = handle(api.score, "openai")
    return [Route(p, rerank, methods=["POST"]) for p in RERANK_PATHS] + [
        Route(p, score, methods=["POST"]) for p in SCORE_PATHS
    ]


class Rerank:
    def __init__(self, state: ServerState):
        self.state = state

    async def rerank(self, request: Request) -> Response:
        req: RerankRequest = parse(RerankRequest, await request.body())
        version, path = await self._scorer(req.model)
        queries, documents = rerank_pairs(req, version)
        tokens = token_counts(version, queries, documents, path.pair_counter(), "documents")
        scores = await self._scores(request, version, queries, documents)
        return _json(rerank_body(req, scores, tokens))

    async def score(self, request: Request) -> Response:
        req: ScoreRequest = parse(ScoreRequest, await request.body())
        version, path = await self._scorer(req.model)
        queries, documents = score_pairs(req, version)
        single = isinstance(req.text_2, str)
        counter = path.pair_counter()
        tokens = token_counts(version, queries, documents, counter, "text_2", single)
        scores = await self._scores(request, version, queries, documents)
        return _json(score_body(req, scores, tokens))

    async def _scorer(self, model: str) -> tuple[ModelVersion, object]:
        await self.state.repository.ensure_loaded(model)
        version = self.state.serving(model)
        path = version.serving("score")  # NotSupported: 400, param "model"
        one_score_each(version)
        return version, path

    async def _scores(
        self, http: Request, version: ModelVersion, queries: list[str], documents: list[str]
    ) -> list[float]:
        """Every pair's score, its requests queued together (a full queue refuses the
        rest, and what was queued is taken back)."""
        tickets = []
        try:
            for job in pair_requests(version, queries, documents):
                tickets.append(version.start(job))
        except BaseException as e:  # a full queue: what was queued goes back, unawaited
            for ticket in tickets:
                ticket.cancel(e)
                ticket.result.cancel()
            raise
        gone = ClientGone("client disconnected")

        def cancel() -> None:
            for ticket in tickets:
                ticket.cancel(gone)

        gathered = asyncio.gather(*(t.result for t in tickets))
        outputs = await until_disconnect(http, gathered, cancel)
        name = version.config.output[0].name
        return [float(s) for out in outputs for s in out[name].reshape(-1).tolist()]


def _json(doc: dict) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")
