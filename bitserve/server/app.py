"""The HTTP app: the v2 protocol's health, metadata and infer routes over the repository.

Errors are `{"error": "..."}` with Triton's status mapping (400 for the caller's
mistakes, 404 unknown model or version, 503 not ready), plus 413 for a body over the
cap, 429 with Retry-After for a full queue and 504 for a request whose timeout passed
in the queue. A client that disconnects while its request is still queued takes the
request out of the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
import zlib
from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from bitserve import __version__
from bitserve.batching.batcher import QueueFull, QueueTimeout
from bitserve.batching.batcher import Request as BatchRequest
from bitserve.repository.repository import ModelNotFound, ModelUnavailable, Repository
from bitserve.repository.version import ExecutionError, ModelVersion
from bitserve.server.v2 import HEADER_LENGTH, InvalidRequest, encode_response, parse_infer

log = logging.getLogger("bitserve.server")

DEFAULT_MAX_BODY = 64 * 1024 * 1024  # Triton's --http-max-input-size
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]


class BodyTooLarge(Exception):
    pass


def json_response(doc: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def error(status: int, message: str, headers: dict | None = None) -> Response:
    return json_response({"error": message}, status, headers)


class V2App:
    """Route handlers bound to one repository."""

    def __init__(self, repository: Repository, max_body: int = DEFAULT_MAX_BODY):
        self.repository = repository
        self.max_body = max_body

    # ---------------------------------------------------------------- health

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "bitserve", "version": __version__, "extensions": EXTENSIONS})

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        reason = self.repository.not_ready_reason()
        return Response(status_code=200) if reason is None else error(503, reason)

    # -------------------------------------------------------------- metadata

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
        return Response(status_code=200)

    async def model_metadata(self, request: Request) -> Response:
        version = self._lookup(request)
        config = version.config
        entry = self.repository.entry(config.name)
        platform = version.instances[0].platform if version.instances else config.backend
        return json_response(
            {
                "name": config.name,
                "versions": [str(v) for v, mv in sorted(entry.versions.items()) if mv.ready],
                "platform": platform,
                "inputs": [
                    {"name": t.name, "datatype": t.datatype, "shape": config.full_shape(t)}
                    for t in config.input
                ],
                "outputs": [
                    {"name": t.name, "datatype": t.datatype, "shape": config.full_shape(t)}
                    for t in config.output
                ],
            }
        )

    async def model_config(self, request: Request) -> Response:
        return json_response(self._lookup(request).config.model_dump(mode="json"))

    async def model_stats(self, request: Request) -> Response:
        names = [request.path_params["model"]] if "model" in request.path_params else None
        stats = []
        for name, entry in self.repository.models.items():
            if names is not None and name not in names:
                continue
            for number, version in sorted(entry.versions.items()):
                if version.batcher is None:
                    continue
                s = version.batcher.stats
                stats.append(
                    {
                        "name": name,
                        "version": str(number),
                        "inference_count": s.inference_count,
                        "execution_count": s.execution_count,
                        "batch_stats": [
                            {"batch_size": size, "count": count}
                            for size, count in sorted(s.batch_sizes.items())
                        ],
                        "queue_seconds": s.queue_seconds,
                        "rejected_queue_full": s.rejected_full,
                        "rejected_timeout": s.rejected_timeout,
                        "cancelled": s.cancelled,
                    }
                )
        if names is not None:
            self.repository.entry(names[0])
        return json_response({"model_stats": stats})

    # ----------------------------------------------------------------- infer

    async def infer(self, request: Request) -> Response:
        version = self._lookup(request)
        body = await self._read_body(request)
        header_length = request.headers.get(HEADER_LENGTH)
        if header_length is not None and not header_length.isdigit():
            raise InvalidRequest("header Inference-Header-Content-Length must be an integer")
        parsed = parse_infer(
            version.config, body, int(header_length) if header_length is not None else None
        )
        outputs = await self._run(request, version, parsed)
        payload, json_length = encode_response(
            version.config.name, version.version, parsed, outputs
        )
        if json_length is None:
            return Response(payload, media_type="application/json")
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(json_length)},
        )

    async def _run(self, http: Request, version: ModelVersion, parsed) -> dict:
        config = version.config
        policy = config.dynamic_batching
        levels = policy.priority_levels if policy else 1
        priority = parsed.priority or (policy.default_priority_level if policy else 0) or levels
        if priority > levels:
            raise InvalidRequest(f"parameter 'priority' {priority} exceeds {levels} levels")
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeout_s = _timeout(policy, parsed.timeout_us)
        future: asyncio.Future = loop.create_future()

        def on_done(outputs, err) -> None:
            if not future.done():
                if err is None:
                    future.set_result(outputs)
                else:
                    future.set_exception(err)

        job = BatchRequest(
            parsed.inputs,
            parsed.rows,
            now,
            priority=priority,
            timeout_at=now + timeout_s if timeout_s else None,
            shape_key=parsed.shape_key,
            on_done=on_done,
        )
        version.submit(job)
        if job.state != "queued":
            return await future  # running already: nothing left to cancel
        return await _await_or_disconnect(http, future, lambda: version.batcher.cancel(job))

    async def _read_body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise BodyTooLarge(f"request body of {length} bytes exceeds {self.max_body}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise BodyTooLarge(f"request body exceeds {self.max_body} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "").lower()
        if encoding in ("gzip", "deflate"):
            body = _decompress(body, encoding, self.max_body)
        elif encoding not in ("", "identity"):
            raise InvalidRequest(f"unsupported Content-Encoding {encoding!r}")
        return body


def _timeout(policy, timeout_us: int) -> float:
    """Seconds: the config's default, or the request's if allowed and shorter."""
    default = (policy.default_timeout_ms / 1000.0) if policy else 0.0
    asked = timeout_us / 1e6
    if asked and (policy is None or policy.allow_timeout_override):
        return min(asked, default) if default else asked
    return default


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


class ClientGone(Exception):
    """The client disconnected while its request was queued (nginx's 499)."""


async def _await_or_disconnect(http: Request, future: asyncio.Future, cancel) -> dict:
    """Wait for the result; if the client goes away first, take the request off the queue.

    A done-callback on the watcher (rather than asyncio.wait) keeps the common path to
    one task and one await."""
    watcher = asyncio.get_running_loop().create_task(_disconnected(http))

    def on_disconnect(task: asyncio.Task) -> None:
        if not task.cancelled() and not future.done():
            cancel()
            future.set_exception(ClientGone("client disconnected"))

    watcher.add_done_callback(on_disconnect)
    try:
        return await future
    finally:
        watcher.cancel()


async def _disconnected(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


STATUS = {
    InvalidRequest: 400,
    ModelNotFound: 404,
    ModelUnavailable: 503,
    BodyTooLarge: 413,
    QueueTimeout: 504,
    ClientGone: 499,
    ExecutionError: 500,
}


def _errors(handler):
    """Turn exceptions into `{"error": ...}` responses with their status."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return _error_response(request, exc)

    return wrapped


def _error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, QueueFull):
        return error(429, str(exc), {"Retry-After": str(exc.retry_after)})
    status = next((code for cls, code in STATUS.items() if isinstance(exc, cls)), 500)
    if status == 500 and not isinstance(exc, ExecutionError):
        log.exception("internal error on %s", request.url.path, exc_info=exc)
    return error(status, str(exc) or type(exc).__name__)


def create_app(
    repository: Repository, max_body: int = DEFAULT_MAX_BODY, load: bool = True
) -> Router:
    """The ASGI app. With `load`, models load in the background after startup so that
    health answers (live, not ready) while they load."""
    v2 = V2App(repository, max_body)
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2", v2.server_metadata),
        Route("/v2/health/live", v2.live),
        Route("/v2/health/ready", v2.ready),
        Route("/v2/models/stats", v2.model_stats),
    ]
    for prefix in (m, mv):
        routes += [
            Route(prefix, _errors(v2.model_metadata)),
            Route(prefix + "/ready", v2.model_ready),
            Route(prefix + "/config", _errors(v2.model_config)),
            Route(prefix + "/stats", _errors(v2.model_stats)),
            Route(prefix + "/infer", _errors(v2.infer), methods=["POST"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Router) -> AsyncIterator[None]:
        task = None
        if load:
            started = time.perf_counter()
            if not repository.models:
                repository.scan()

            async def load_models() -> None:
                await repository.load_all()
                log.info("repository loaded in %.2f s", time.perf_counter() - started)
                _quiet_gc()

            task = asyncio.create_task(load_models())
        yield
        if task is not None:
            task.cancel()
        await repository.unload_all()

    # A bare Router: the handlers turn their own errors into responses, so Starlette's
    # two exception middlewares would only add cost to every request.
    return Router(routes=routes, lifespan=lifespan, default=_not_found)


def _quiet_gc() -> None:
    """Keep the garbage collector from pausing the server under load.

    Loaded models leave millions of long-lived objects (torch modules, tokenizers); every
    full collection walks them all, and at thousands of requests per second those walks
    stalled whole batches for 70-190 ms (the p99 at concurrency 64 was 10x the p50).
    Freezing what exists after loading takes it out of every later collection, and a
    larger first-generation threshold makes collections rarer; request objects are
    freed by reference counting anyway."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


async def _not_found(scope, receive, send) -> None:
    response = error(404, f"{scope['method']} {scope['path']}: no such route")
    await response(scope, receive, send)
