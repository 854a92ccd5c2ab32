"""The OpenAI API's routes over bitserve's LLM engine (and `/v1/embeddings` over hf
embedders); the protocol itself (schemas, errors, bodies) is in bitserve/api/openai.py.

`GET /v1/models`, `POST /v1/completions`, `/v1/chat/completions`, `/v1/embeddings`,
`/tokenize`, `/detokenize`. Streaming is server-sent events ending with
`data: [DONE]`; a client that disconnects aborts its requests, whose KV blocks return
at once. Errors use OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bitserve import tracing
from bitserve.api.openai import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    Responses,
    TokenizeRequest,
    chat_jobs,
    completion_jobs,
    embedding_body,
    embedding_requests,
    embedding_texts,
    parse,
)
from bitserve.backends.llm import EngineRequest, Hold, LLMService
from bitserve.inference import ClientGone
from bitserve.llm import tools
from bitserve.llm.outputs import RequestOutput
from bitserve.repository.version import ModelVersion
from bitserve.server import lora
from bitserve.server.errors import APIError, handle, to_openai
from bitserve.server.http import until_disconnect
from bitserve.server.state import ServerState

OPENAI_TASKS = ("generate", "embed", "score", "images")  # what /v1/models lists


def routes(state: ServerState) -> list[Route]:
    api = OpenAI(state)

    def post(path: str, handler: Any) -> Route:
        return Route(path, handle(handler, "openai"), methods=["POST"])

    return [
        Route("/v1/models", handle(api.models, "openai")),
        post("/v1/completions", api.completions),
        post("/v1/chat/completions", api.chat),
        post("/v1/embeddings", api.embeddings),
        post("/tokenize", api.tokenize),
        post("/detokenize", api.detokenize),
    ]


class OpenAI:
    def __init__(self, state: ServerState):
        self.state = state
        self._turn = asyncio.Lock()  # whose template renders now (_held)

    # ---------------------------------------------------------- lookups

    def _llm(self, name: str) -> tuple[ModelVersion, LLMService]:
        version = self.state.serving(name)
        return version, version.serving("generate")  # NotSupported: 400, param "model"

    async def models(self, request: Request) -> Response:
        data = []
        for name, entry in sorted(self.state.repository.models.items()):
            for number, version in sorted(entry.versions.items()):
                if version.ready and any(map(version.serves, OPENAI_TASKS)):
                    card = {
                        "id": name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "bitserve",
                        "version": str(number),
                    }
                    if version.serves("generate"):  # the context it serves (vLLM's field too)
                        card["max_model_len"] = version.serving("generate").max_model_len
                    data.append(card)
                    break
        data += lora.cards(self.state)  # adapters, with their `parent`
        return _json({"object": "list", "data": data})

    # ---------------------------------------------------------- generation

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await request.body())
        return await self._generate(request, req, lambda llm: completion_jobs(req), chat=False)

    async def chat(self, request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await request.body())
        return await self._generate(request, req, lambda llm: chat_jobs(req, llm), chat=True)

    async def _generate(self, http: Request, req: Any, make_jobs: Any, chat: bool) -> Response:
        model, adapter = lora.resolve(self.state, req.model)
        version, llm, hold = await self._held(model)
        try:  # this request's turn to render (_held): no await until it is admitted
            try:
                jobs = lora.with_adapter(make_jobs(llm), adapter)
            except BaseException:  # a 4xx before the front door: the place goes back now
                if hold is not None:
                    hold.release()
                raise
            # the front door: encoded, checked against the one set of limits, admitted once
            prompts, params = [p for p, _, _ in jobs], [sp for _, _, sp in jobs]
            admitted = llm.process(prompts, params, hold=hold)
            # the session key of sticky routing (Ray LLM replicas with route_sessions)
            session = http.headers.get("x-session-id") or req.user
            for job in admitted:
                job.session = session
            # held now, with no await since the lookup: a drain cannot miss it
            stream = _Streams(self.state, version, llm, req, jobs, admitted, chat)
        finally:
            self._turn.release()
        if req.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream")
        return _json(await until_disconnect(http, stream.complete()))

    async def _held(self, model: str) -> tuple[ModelVersion, LLMService, Hold | None]:
        """The model's LLM with a place held in its waiting queue (or a 429 now), then
        one turn of the event loop: in a burst every request is held or refused before
        any of them renders a template, so a refusal costs microseconds, not the
        encoding of all the requests ahead of it. Then the turn to render (`_turn`, the
        caller releases it): one template per pass of the event loop, so requests that
        arrive meanwhile are read, and refused, between two templates rather than after
        all of them. Looked up again after these awaits: no await may come between the
        lookup and the lease (a drain must not miss it)."""
        await self.state.repository.ensure_loaded(model)
        _, llm = self._llm(model)
        hold = llm.hold()
        try:
            await asyncio.sleep(0)
            await self._turn.acquire()
        except BaseException:
            hold.release()
            raise
        try:
            version, now = self._llm(model)
        except BaseException:
            hold.release()
            self._turn.release()
            raise
        if now is not llm:  # reloaded meanwhile: the new service admits it in process
            hold.release()
            return version, now, None
        return version, llm, hold

    # ---------------------------------------------------------- embeddings

    async def embeddings(self, request: Request) -> Response:
        req: EmbeddingRequest = parse(EmbeddingRequest, await request.body())
        await self.state.repository.ensure_loaded(req.model)
        version = self.state.serving(req.model)
        embedder = version.serving("embed")  # NotSupported: 400, param "model"
        texts = embedding_texts(req)
        vectors = await self._embed(request, version, texts)
        return _json(embedding_body(req, texts, vectors, version, embedder.token_counter()))

    async def _embed(self, http: Request, version: ModelVersion, texts: list[str]) -> list:
        results: list = []
        gone = ClientGone("client disconnected")
        for job in embedding_requests(version, texts):
            ticket = version.start(job)
            outputs = await until_disconnect(http, ticket.result, lambda t=ticket: t.cancel(gone))
            results.extend(outputs[version.config.output[0].name])
        return results

    # ---------------------------------------------------------- tokenizer

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = parse(TokenizeRequest, await request.body())
        _, llm = self._llm(req.model)
        if req.messages is not None:
            ids = llm.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages])
        elif req.prompt is not None:
            ids = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "invalid_request_error", "prompt")
        return _json({"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())
        _, llm = self._llm(req.model)
        vocab = len(llm.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(
                400, f"tokens must be in [0, {vocab})", "invalid_request_error", "tokens"
            )
        return _json({"prompt": llm.tokenizer.decode(req.tokens)})


# --------------------------------------------------------------- streaming


class _Streams(Responses):
    """Every (prompt, choice) of one API request as engine requests, merged in order of
    arrival; closing it early (a disconnect) aborts all of them."""

    def __init__(
        self,
        server: ServerState,
        version: ModelVersion,
        llm: LLMService,
        req: Any,
        jobs: list,
        admitted: list[EngineRequest],
        chat: bool,
    ):
        super().__init__(llm, req, jobs, chat)
        self.state, self.version, self.admitted = server, version, admitted
        self.labels = (version.config.name, str(version.version))
        self.lease = version.begin()

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(job index, output) as outputs arrive from every job."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int) -> None:
            try:
                admitted = self.admitted[index]
                outs = self.llm.generate(admitted, priority=self.req.priority)
                async for out in tracing.generation(self.labels[0], outs):
                    await queue.put((index, out))
            except BaseException as e:
                await queue.put((index, e))
                raise

        tasks = [asyncio.create_task(run(i)) for i in range(len(self.jobs))]
        recorder = _Recorder(self.state, self.labels)
        finished: set[int] = set()
        try:
            while len(finished) < len(tasks):
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                recorder.saw(index, item)
                if item.finished:
                    finished.add(index)
                yield index, item
        finally:
            # Bookkeeping before any await: under anyio's cancellation (a client that
            # left a stream) every later await raises again.
            for task in tasks:
                task.cancel()
            recorder.aborted(len(tasks) - len(finished))
            for admitted in self.admitted:  # a job that never started gives its place back
                admitted.release()
            self.lease.release()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.events():
            if out.finished:
                finals[index] = out
        return self.body(finals)

    async def sse(self) -> AsyncIterator[bytes]:
        sent = [0] * len(self.jobs)  # tokens already sent per choice
        finals: dict[int, RequestOutput] = {}
        calls = None
        if self.chat and self.req.calls_tools():
            calls = [tools.ToolStream(self.llm.tool_parser) for _ in self.jobs]
        try:
            if self.chat:
                for i in range(len(self.jobs)):
                    yield self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            echoed: set[int] = set()
            async for index, out in self.events():
                completion = out.outputs[0]
                if not self.chat and self.req.echo and index not in echoed:  # the prompt first
                    echoed.add(index)
                    scored = completion.logprobs is not None
                    logprobs = self.echo_logprobs(out, [], []) if scored else None
                    yield self._chunk(index, self.prompt_text(index), logprobs, None)
                if self.echo_only:  # its one sampled token is not part of the answer
                    if out.finished:
                        finals[index] = out
                        yield self._chunk(index, "", None, "length")
                    continue
                new_ids = completion.token_ids[sent[index] :]
                logprobs = None
                if completion.logprobs is not None and new_ids:
                    new = completion.logprobs[sent[index] :]
                    logprobs = (
                        {"content": self._chat_logprobs(new_ids, new)}
                        if self.chat
                        else self._completion_logprobs(new_ids, new, 0)
                    )
                sent[index] = len(completion.token_ids)
                if out.finished:
                    finals[index] = out
                if calls is not None:  # content and tool-call deltas, as OpenAI streams them
                    for chunk in self._tool_chunks(calls[index], index, completion, out.finished):
                        yield chunk
                elif completion.delta_text or out.finished or logprobs:
                    delta = (
                        {"content": completion.delta_text} if self.chat else (completion.delta_text)
                    )
                    yield self._chunk(index, delta, logprobs, completion.finish_reason)
            if (self.req.stream_options or {}).get("include_usage"):
                usage_doc = self._envelope([], self._usage(finals))
                usage_doc["object"] = self._chunk_object()
                yield b"data: " + orjson.dumps(usage_doc) + b"\n\n"
        except Exception as e:  # headers are gone: report the error as an event
            error = to_openai(e)
            doc = {"error": {"message": str(error), "type": error.kind, "code": error.code}}
            yield b"data: " + orjson.dumps(doc) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _tool_chunks(
        self, stream: tools.ToolStream, index: int, completion: Any, finished: bool
    ) -> list[bytes]:
        deltas = stream.feed(completion.delta_text, finished)
        chunks = [self._chunk(index, delta, None, None) for delta in deltas]
        if finished:
            finish = "tool_calls" if stream.index >= 0 else completion.finish_reason
            chunks.append(self._chunk(index, {}, None, finish))
        return chunks

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, delta: Any, logprobs: Any, finish: str | None) -> bytes:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        choice["delta" if self.chat else "text"] = delta
        doc = {
            "id": self.id,
            "object": self._chunk_object(),
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }
        return b"data: " + orjson.dumps(doc) + b"\n\n"


class _Recorder:
    """vLLM's latency metrics: TTFT from arrival, TPOT excluding the first token, ITL."""

    def __init__(self, server: ServerState, labels: tuple[str, str]):
        self.m = server.metrics
        self.labels = labels
        self.start = time.perf_counter()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def saw(self, index: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        count = len(out.outputs[0].token_ids)
        if index not in self.first and count:
            self.first[index] = now
            self.m.llm_ttft.labels(*self.labels).observe(now - self.start)
        elif count > self.tokens.get(index, 0) and index in self.last:
            self.m.llm_itl.labels(*self.labels).observe(now - self.last[index])
        if count > self.tokens.get(index, 0):
            self.last[index] = now
            self.tokens[index] = count
        if out.finished:
            self.m.llm_e2e.labels(*self.labels).observe(now - self.start)
            scheduled, arrived = (
                out.metrics.get(k, 0.0) for k in ("first_scheduled_time", "arrival_time")
            )
            if scheduled and arrived:
                self.m.llm_queue.labels(*self.labels).observe(scheduled - arrived)
            self.m.llm_prompt_tokens.labels(*self.labels).inc(len(out.prompt_token_ids))
            self.m.llm_generation_tokens.labels(*self.labels).inc(count)
            if count > 1:
                tpot = (now - self.first[index]) / (count - 1)
                self.m.llm_tpot.labels(*self.labels).observe(tpot)
            reason = out.outputs[0].finish_reason or "abort"
            self.m.llm_finished.labels(*self.labels, reason).inc()

    def aborted(self, count: int) -> None:
        """Requests that ended early (a client that left, an error)."""
        if count:
            self.m.llm_finished.labels(*self.labels, "abort").inc(count)


# ----------------------------------------------------------------- helpers


def _json(doc: dict) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )
