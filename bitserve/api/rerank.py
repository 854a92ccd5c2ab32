"""Rerank and score apart from HTTP: request schemas, their limits, the pairs as v2
requests, and the response bodies.

Two wire formats over one computation, a cross-encoder's score of (query, document)
pairs (an hf model with `task = "cross-encoder"`, bitserve/backends/hf.py):

- rerank, Cohere's and Jina's shape (vLLM's `/v1/rerank` too): `query`, `documents`
  (strings or objects with `text`), `top_n`, `return_documents` -> `results` of `index`,
  `relevance_score` and, when asked, `document`, best first; `usage.total_tokens`.
- score, vLLM's `/v1/score`: `text_1` and `text_2`, each a string or a list; one
  `text_1` is paired with every `text_2`, else the lists pair item by item -> `data` of
  `index` and `score`, in the pairs' order.

Every pair goes through the model's dynamic batcher as rows of v2 requests of at most
`max_batch_size` rows, all queued at once, so the pairs of concurrent requests share
batches. The model's limits come from its config (`max_documents`, `max_length`,
`truncate`); a request past one is a 400 naming the field before anything is queued.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, Field

from bitserve.api.errors import APIError
from bitserve.api.openai import STRICT
from bitserve.backends.hf import MAX_DOCUMENTS
from bitserve.batching.collate import shape_key
from bitserve.inference import InferRequest
from bitserve.repository.version import ModelVersion


class Document(BaseModel):
    model_config = STRICT
    text: str


class RerankRequest(BaseModel):
    model_config = STRICT
    model: str
    query: str
    documents: Annotated[list[str | Document], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = False

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(BaseModel):
    model_config = STRICT
    model: str
    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]


def rerank_pairs(req: RerankRequest, version: ModelVersion) -> tuple[list[str], list[str]]:
    """(queries, documents): the query beside each document, within the model's limits."""
    documents = req.texts()
    _check_count(version, len(documents), "documents")
    _check_texts([req.query], "query", single=True)
    _check_texts(documents, "documents")
    return [req.query] * len(documents), documents


def score_pairs(req: ScoreRequest, version: ModelVersion) -> tuple[list[str], list[str]]:
    """(text_1, text_2) paired as vLLM pairs them: one text_1 against every text_2, or
    two lists of one length item by item."""
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(first) not in (1, len(second)):
        raise APIError(
            400,
            f"text_2: {len(second)} texts for {len(first)} text_1; give one text_1 or "
            "as many as text_2",
            param="text_2",
        )
    _check_count(version, len(second), "text_2")
    _check_texts(first, "text_1", single=isinstance(req.text_1, str))
    _check_texts(second, "text_2", single=isinstance(req.text_2, str))
    return first * len(second) if len(first) == 1 else first, second


def _check_count(version: ModelVersion, count: int, field: str) -> None:
    limit = version.config.parameters.get("max_documents", MAX_DOCUMENTS)
    if count > limit:
        raise APIError(
            400, f"{field}: {count} documents, over the model's limit of {limit}", param=field
        )


def _check_texts(texts: list[str], field: str, single: bool = False) -> None:
    for i, text in enumerate(texts):
        if not text.strip():
            name = field if single else f"{field}.{i}"
            raise APIError(400, f"{name}: the text is empty", param=name)


def token_counts(
    version: ModelVersion,
    queries: list[str],
    documents: list[str],
    counter: Callable[[list[str], list[str]], tuple[list[int], int]] | None,
    field: str,
    single: bool = False,
) -> list[int]:
    """Each pair's tokens as the model reads it (truncated at max_length), for usage;
    with `truncate = false` a pair past max_length is a 400 naming its document."""
    if counter is None:  # a model in another process: no tokenizer here
        return [0] * len(queries)
    counts, limit = counter(queries, documents)
    if not version.config.parameters.get("truncate", True):
        for i, count in enumerate(counts):
            if count > limit:
                name = field if single else f"{field}.{i}"
                raise APIError(
                    400,
                    f"{name}: the pair is {count} tokens, over the model's max_length of "
                    f"{limit} (the model does not truncate: parameters.truncate = false)",
                    param=name,
                )
    return [min(count, limit) for count in counts]


def pair_requests(
    version: ModelVersion, queries: list[str], documents: list[str]
) -> Iterator[InferRequest]:
    """The pairs as v2 requests of at most max_batch_size rows."""
    config = version.config
    names = [spec.name for spec in config.input]
    limit = max(config.max_batch_size, 1)
    for start in range(0, len(queries), limit):
        inputs = {}
        for name, texts in zip(names, (queries, documents), strict=True):
            chunk = texts[start : start + limit]
            array = np.empty((len(chunk), 1), dtype=object)
            array[:, 0] = [t.encode() for t in chunk]
            inputs[name] = array
        rows = len(inputs[names[0]])
        yield InferRequest(inputs, rows, shape_key(config, inputs))


def one_score_each(version: ModelVersion) -> None:
    """Rerank and score rank by one number per pair: a model of several labels (an NLI
    cross-encoder) serves v2 infer only."""
    spec = version.config.output[0]
    if int(np.prod(spec.dims or [1])) != 1:
        raise APIError(
            400,
            f"model '{version.config.name}' gives {spec.dims} scores per pair; rerank and "
            "score need one (use v2 infer)",
            param="model",
        )


def rerank_body(req: RerankRequest, scores: list[float], tokens: list[int]) -> dict:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    texts = req.texts()
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": "rerank-" + uuid.uuid4().hex,
        "model": req.model,
        "results": results,
        "usage": {"total_tokens": sum(tokens)},
    }


def score_body(req: ScoreRequest, scores: list[float], tokens: list[int]) -> dict:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    total = sum(tokens)
    return {
        "id": "score-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": req.model,
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
