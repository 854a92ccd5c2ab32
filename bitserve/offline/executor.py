"""One input record in, one output line out: the server's model code, without HTTP.

`prepare` parses and validates a record at once (so a bad one becomes an error line
without touching a model, and its length is known for bucketing); `run` executes it.
OpenAI lines are parsed with the server's own request schemas and answered with its
own response builders (`bitserve.api.openai`), so a batch output body equals what
`serve` returns. LLM jobs go straight to the engine, skipping the server's admission
gate (`process(queue=False)`): offline there is no caller to answer 429, only an
engine to keep full.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bitserve.api import errors
from bitserve.api import openai as api
from bitserve.batching.batcher import QueueFull
from bitserve.batching.collate import shape_key
from bitserve.inference import InferRequest
from bitserve.offline.records import Record, error_line, ok_line, record_key
from bitserve.offline.rows import RowMapping, row_inputs, v2_body
from bitserve.repository.repository import Repository
from bitserve.repository.version import ModelVersion

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"}


@dataclass
class Work:
    """A validated record: its key, a length for bucketing, and the coroutine to run."""

    custom_id: str
    line: int
    length: int
    run: Callable[[], Awaitable[dict]]


class Executor:
    def __init__(self, repository: Repository, rows: RowMapping | None = None):
        self.repository = repository
        self.rows = rows

    def prepare(self, record: Record) -> Work | dict:
        """A Work, or the error line that answers the record."""
        custom_id = record_key(record, self.rows.id_column if self.rows else None)
        try:
            if isinstance(record.raw, dict):
                return self._prepare_row(record, custom_id)
            return self._prepare_openai(record, custom_id)
        except Exception as e:
            return failure(custom_id, record.line, e)

    async def run(self, work: Work) -> dict:
        try:
            return await work.run()
        except Exception as e:
            return failure(work.custom_id, work.line, e)

    # ------------------------------------------------------------ OpenAI lines

    def _prepare_openai(self, record: Record, custom_id: str | None) -> Work | dict:
        try:
            doc = orjson.loads(record.raw)
        except orjson.JSONDecodeError as e:
            return error_line(None, record.line, "invalid_json", f"malformed JSON: {e}")
        if custom_id is None:
            return error_line(None, record.line, "invalid_request", "needs a string 'custom_id'")
        method, url, body = doc.get("method", "POST"), doc.get("url"), doc.get("body")
        if method != "POST" or url not in ENDPOINTS or not isinstance(body, dict):
            message = f"needs method POST, a url in {sorted(ENDPOINTS)} and an object 'body'"
            return error_line(custom_id, record.line, "invalid_request", message)
        raw = orjson.dumps(body)
        if url == "/v1/embeddings":
            return self._embeddings(custom_id, record.line, raw)
        return self._generation(custom_id, record.line, raw, chat=url.endswith("chat/completions"))

    def _version(self, name: str) -> ModelVersion:
        try:
            return self.repository.get(name)
        except Exception as e:
            raise errors.to_openai(e) from None

    def _generation(self, custom_id: str, line: int, raw: bytes, chat: bool) -> Work:
        req = api.parse(api.ChatRequest if chat else api.CompletionRequest, raw)
        version = self._version(req.model)
        llm = version.serving("generate")  # NotSupported: a 400 naming the model
        jobs = api.chat_jobs(req, llm) if chat else api.completion_jobs(req)
        # the server's front door, but no admission gate: nobody here to answer 429
        admitted = llm.process([p for p, _, _ in jobs], [sp for _, _, sp in jobs], queue=False)

        async def run() -> dict:
            responses = api.Responses(llm, req, jobs, chat)
            outs = await asyncio.gather(*(_generate(llm, a, req.priority) for a in admitted))
            return ok_line(custom_id, responses.body(dict(enumerate(outs))))

        return Work(custom_id, line, sum(len(a.ids) for a in admitted), run)

    def _embeddings(self, custom_id: str, line: int, raw: bytes) -> Work:
        req = api.parse(api.EmbeddingRequest, raw)
        version = self._version(req.model)
        count_tokens = version.serving("embed").token_counter()  # NotSupported: a 400
        texts = api.embedding_texts(req)

        async def run() -> dict:
            vectors = await _embed(version, texts)
            body = api.embedding_body(req, texts, vectors, version, count_tokens)
            return ok_line(custom_id, body)

        return Work(custom_id, line, max(map(len, texts)), run)

    # ------------------------------------------------------------ plain rows

    def _prepare_row(self, record: Record, custom_id: str | None) -> Work | dict:
        assert self.rows is not None
        if custom_id is None:
            message = f"row has no value in --id-column {self.rows.id_column!r}"
            return error_line(None, record.line, "invalid_request", message)
        version = self._version(self.rows.model)
        inputs, length = row_inputs(version.config, self.rows, record.raw)

        async def run() -> dict:
            request = InferRequest(inputs, 1, shape_key(version.config, inputs))
            outputs = await _submit(version, request)
            return ok_line(custom_id, v2_body(version, outputs))

        return Work(custom_id, record.line, length, run)


def failure(custom_id: str | None, line: int, e: BaseException) -> dict:
    """The error line for an exception, in the online server's error shape."""
    error = errors.to_openai(e)
    fields = {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}
    body = {"error": fields}
    code = error.code or error.kind
    return error_line(custom_id, line, code, str(error), error.status, body)


async def _generate(llm: Any, admitted: Any, priority: int) -> Any:
    """The final output of one engine request (the engine streams; batch needs the end)."""
    final = None
    async for out in llm.generate(admitted, priority=priority, stream=False):
        final = out
    return final


async def _embed(version: ModelVersion, texts: list[str]) -> list:
    """Through the dynamic batcher, as the online /v1/embeddings sends them."""
    results: list = []
    for request in api.embedding_requests(version, texts):
        outputs = await _submit(version, request)
        results.extend(outputs[version.config.output[0].name])
    return results


async def _submit(version: ModelVersion, request: InferRequest) -> dict:
    """One request on the version's one path; a full queue means wait, not fail (nobody
    is waiting on us)."""
    while True:
        try:
            ticket = version.start(request)
        except QueueFull:
            await asyncio.sleep(0.005)
            continue
        return await ticket.result
