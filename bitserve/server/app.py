"""The HTTP app: the v2 protocol's metadata and infer routes, health, metrics and the
repository extension, over one repository.

Errors are `{"error": "..."}` with Triton's status mapping (400 for the caller's
mistakes, 404 unknown model or version, 503 not ready or draining), plus 413 for a body
over the cap, 429 with Retry-After for a full queue and 504 for a request whose timeout
passed in the queue. A client that disconnects while its request is still queued takes
the request out of the queue.
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
from dataclasses import dataclass, field
from typing import Any, TextIO

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from bitserve import __version__, coldstart
from bitserve.backends import preimport
from bitserve.backends.llm import NoChatTemplate, Overloaded, PromptTooLong
from bitserve.batching.batcher import QueueFull, QueueTimeout
from bitserve.batching.batcher import Request as BatchRequest
from bitserve.llm.async_engine import EngineDead, RequestFailed
from bitserve.metrics import Metrics
from bitserve.repository.repository import ModelNotFound, ModelUnavailable, Repository
from bitserve.repository.version import ExecutionError, ModelVersion, ReplicaLost
from bitserve.rollout.policy import VERSION_HEADER
from bitserve.rollout.state import Rollouts
from bitserve.rollout.state import Route as RolloutRoute
from bitserve.server import admin, generate, health, images, openai
from bitserve.server.http import error, json_response, until_disconnect
from bitserve.server.v2 import HEADER_LENGTH, InvalidRequest, encode_response, parse_infer

log = logging.getLogger("bitserve.server")

DEFAULT_MAX_BODY = 64 * 1024 * 1024  # Triton's --http-max-input-size
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "model_repository"]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected while its request was queued (nginx's 499)."""


class Draining(Exception):
    """The server is shutting down; it takes no new requests (503)."""


@dataclass
class ServerOptions:
    max_body: int = DEFAULT_MAX_BODY
    admin_token: str | None = None  # repository management is off without one
    model_control: str = "none"  # none | explicit | poll
    startup_models: list[str] | None = None  # explicit: what to load at start (None: all)
    poll_seconds: float = 15.0
    access_log: TextIO | None = None
    lazy_load: bool = False  # load each model on its first request (scale to zero)
    process_started: float = field(default_factory=coldstart.process_start_time)
    imported: float = field(default_factory=time.time)  # when serving code was importable


class Server:
    """The app's state and its v2 handlers. `drain` is what SIGTERM calls."""

    def __init__(self, repository: Repository, options: ServerOptions, metrics: Metrics):
        self.repository = repository
        self.options = options
        self.metrics = metrics
        self.rollout = Rollouts(repository, metrics)  # canary and shadow traffic
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Turn unready, refuse new requests, wait for in-flight ones (False on timeout)."""
        self.draining = True
        log.info("draining: waiting up to %.0f s for %d request(s)", timeout, self.inflight)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            log.error("drain timed out with %d request(s) in flight", self.inflight)
            return False

    # -------------------------------------------------------------- metadata

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "bitserve", "version": __version__, "extensions": EXTENSIONS})

    async def openapi(self, request: Request) -> Response:
        from bitserve.server.openapi import document

        models = self.repository.models.items()
        return json_response(document({n: e.config.backend for n, e in models if e.config}))

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
        return Response(status_code=503 if self.draining else 200)

    async def model_metadata(self, request: Request) -> Response:
        version = self._lookup(request)
        config = version.config
        entry = self.repository.entry(config.name)
        return json_response(
            {
                "name": config.name,
                "versions": [str(v) for v, mv in sorted(entry.versions.items()) if mv.ready],
                "platform": version.platform,
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
        wanted = request.path_params.get("model")
        if wanted is not None:
            self.repository.entry(wanted)
        stats = []
        for name, entry in sorted(self.repository.models.items()):
            if wanted is not None and name != wanted:
                continue
            for number, version in sorted(entry.versions.items()):
                if version.batcher is not None:
                    stats.append(_stats(name, number, version))
        return json_response({"model_stats": stats})

    # ----------------------------------------------------------------- infer

    async def infer(self, request: Request) -> Response:
        if self.draining:
            raise Draining("server is draining; send requests elsewhere")
        self.inflight += 1
        self._idle.clear()
        try:
            body = await self._read_body(request)
            await self.repository.ensure_loaded(request.path_params["model"])
            # Choose the version only now: from here to its queue nothing awaits, so a
            # version swapped out meanwhile cannot be drained between the two.
            version, route = self.route(request)
            return await self._infer(request, version, body, route)
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    def route(self, request: Request) -> tuple[ModelVersion, RolloutRoute | None]:
        """`route_model` for a v2 request: pinned by its path or header."""
        pinned = request.path_params.get("version") or request.headers.get(VERSION_HEADER)
        return self.route_model(request.path_params["model"], pinned)

    def route_model(
        self, model: str, pinned: str | None = None
    ) -> tuple[ModelVersion, RolloutRoute | None]:
        """The version that answers: a pinned one as asked, else the model's traffic
        policy's choice, else the highest ready version."""
        route = self.rollout.route(model) if pinned is None else None
        if route is not None:
            return route.version, route
        return self.repository.get(model, pinned), None

    async def _infer(
        self,
        request: Request,
        version: ModelVersion,
        body: bytes,
        route: RolloutRoute | None = None,
    ) -> Response:
        labels = (version.config.name, str(version.version))
        inflight = version.m["inflight"]
        inflight.inc()
        started = time.perf_counter()
        job: BatchRequest | None = None
        status = 500
        parsed = outputs = None
        try:
            header_length = request.headers.get(HEADER_LENGTH)
            if header_length is not None and not header_length.isdigit():
                raise InvalidRequest("header Inference-Header-Content-Length must be an integer")
            parsed = parse_infer(
                version.config, body, int(header_length) if header_length is not None else None
            )
            if version.llm is not None:
                outputs = await generate.infer(request, version, parsed.inputs)
            else:
                job, outputs = await self._run(request, version, parsed)
            payload, json_length = encode_response(
                version.config.name, version.version, parsed, outputs
            )
            status = 200
        except Exception as exc:
            status = status_of(exc)
            self.metrics.failure.labels(*labels, reason_of(exc)).inc()
            raise
        finally:
            inflight.dec()
            seconds = time.perf_counter() - started
            version.m["duration"].observe(seconds)
            if self.options.access_log is not None:
                _access_log(self.options.access_log, labels, status, seconds, job)
            if route is not None:
                route.finish(status, seconds, parsed, outputs)
        version.m["success"].inc()
        if json_length is None:
            return Response(payload, media_type="application/json")
        return Response(
            payload,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(json_length)},
        )

    async def rollout_report(self, request: Request) -> Response:
        """The canary and shadow verdict (`bitserve rollout report`)."""
        entry = self.repository.entry(request.path_params["model"])
        rollout = self.rollout.get(entry)
        if rollout is None:
            raise ModelNotFound(f"model '{entry.name}' has no traffic policy")
        from bitserve.rollout import verdict

        # bootstraps and scipy's import take tens of ms: off the loop, on a copy
        return json_response(await asyncio.to_thread(verdict.report, rollout.snapshot()))

    async def _run(
        self, http: Request, version: ModelVersion, parsed: Any
    ) -> tuple[BatchRequest, dict]:
        config = version.config
        policy = config.dynamic_batching
        levels = policy.priority_levels if policy else 1
        priority = parsed.priority or (policy.default_priority_level if policy else 0) or levels
        if priority > levels:
            raise InvalidRequest(f"parameter 'priority' {priority} exceeds {levels} levels")
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeout_s = _timeout(policy, parsed.timeout_us)
        try:
            version.validate(parsed.inputs)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        job = BatchRequest(
            parsed.inputs,
            parsed.rows,
            now,
            priority=priority,
            timeout_at=now + timeout_s if timeout_s else None,
            shape_key=parsed.shape_key,
        )
        future = version.submit(job)
        if job.state != "queued":
            return job, await future  # running already: nothing left to cancel
        cancel = functools.partial(version.cancel, job, ClientGone("client disconnected"))
        return job, await until_disconnect(http, future, cancel)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.options.max_body
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


def _stats(name: str, number: int, version: ModelVersion) -> dict:
    assert version.batcher is not None
    s = version.batcher.stats
    return {
        "name": name,
        "version": str(number),
        "state": version.state,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "batch_stats": [
            {"batch_size": size, "count": count} for size, count in sorted(s.batch_sizes.items())
        ],
        "queue_seconds": s.queue_seconds,
        "queue_depth": version.batcher.queued,
        "rejected_queue_full": s.rejected_full,
        "rejected_timeout": s.rejected_timeout,
        "cancelled": s.cancelled,
    }


def _access_log(out: TextIO, labels: tuple, status: int, seconds: float, job: Any) -> None:
    """One JSON line per infer request, for `bitserve plan fit` and friends."""
    record = {
        "time": time.time(),
        "model": labels[0],
        "version": labels[1],
        "status": status,
        "duration_ms": round(seconds * 1000, 3),
        "queue_ms": round(job.queue_seconds * 1000, 3) if job else None,
        "compute_ms": round(job.compute_seconds * 1000, 3) if job else None,
        "batch_size": job.batch_rows if job else None,
        "rows": job.rows if job else None,
    }
    out.write(orjson.dumps(record).decode() + "\n")
    out.flush()


def _timeout(policy: Any, timeout_us: int) -> float:
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


# ---------------------------------------------------------------------- errors

STATUS = {
    InvalidRequest: 400,
    PromptTooLong: 400,
    NoChatTemplate: 400,
    ModelNotFound: 404,
    ModelUnavailable: 503,
    Draining: 503,
    ReplicaLost: 503,
    EngineDead: 503,
    BodyTooLarge: 413,
    QueueFull: 429,
    Overloaded: 429,
    QueueTimeout: 504,
    ClientGone: 499,
    ExecutionError: 500,
}
REASONS = {
    QueueFull: "rejected",
    Overloaded: "rejected",
    QueueTimeout: "timeout",
    ClientGone: "cancelled",
    ExecutionError: "backend",
    ReplicaLost: "backend",
    EngineDead: "unavailable",
    RequestFailed: "backend",
    InvalidRequest: "invalid",
    BodyTooLarge: "invalid",
    ModelUnavailable: "unavailable",
    Draining: "unavailable",
}


def status_of(exc: BaseException) -> int:
    return next((code for cls, code in STATUS.items() if isinstance(exc, cls)), 500)


def reason_of(exc: BaseException) -> str:
    return next((r for cls, r in REASONS.items() if isinstance(exc, cls)), "other")


def errors(handler: Any) -> Any:
    """Turn exceptions into `{"error": ...}` responses with their status."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            status = status_of(exc)
            if status == 500 and not isinstance(exc, ExecutionError | RequestFailed):
                log.exception("internal error on %s", request.url.path, exc_info=exc)
            # an error that says when to come back (queue full, overloaded, replica lost)
            retry_after = getattr(exc, "retry_after", None)
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
            return error(status, str(exc) or type(exc).__name__, headers)

    return wrapped


async def _not_found(scope: dict, receive: Any, send: Any) -> None:
    response = error(404, f"{scope['method']} {scope['path']}: no such route")
    await response(scope, receive, send)


def _report_startup(repository: Repository, options: ServerOptions, imports: float) -> None:
    versions = [v for e in repository.models.values() for v in e.versions.values() if v.ready]
    spans = [span for v in versions for span in v.spans]
    startup = coldstart.breakdown(
        options.process_started,
        options.imported,
        time.time(),
        loads=[load for load, _ in spans],
        warmups=[warmup for _, warmup in spans],
        preimport=imports,
    )
    for phase, seconds in startup.phases().items():
        repository.metrics.startup.labels(phase).set(seconds)
    reason = repository.not_ready_reason()
    if reason is None:  # "ready ..." only when /v2/health/ready answers 200
        log.info(startup.describe())
    else:
        log.error("loading ended, NOT ready: %s", reason)


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


# ------------------------------------------------------------------------- app


class App:
    """The ASGI app: a bare Starlette Router (the handlers turn their own errors into
    responses, so Starlette's exception middlewares would only add cost per request)."""

    def __init__(self, server: Server, router: Router):
        self.server = server
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.router(scope, receive, send)


def create_app(
    repository: Repository,
    options: ServerOptions | None = None,
    metrics: Metrics | None = None,
    load: bool = True,
) -> App:
    """The ASGI app. With `load`, models load in the background after startup so that
    health answers (live, not ready) while they load."""
    options = options or ServerOptions()
    metrics = metrics or repository.metrics
    repository.metrics = metrics
    server = Server(repository, options, metrics)
    probes = health.Health(server)
    management = admin.Admin(server)
    metrics.add_collector(functools.partial(health.collect, server))
    m, mv = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    routes = [
        # infer first: the router tries routes in order
        Route(m + "/infer", errors(server.infer), methods=["POST"]),
        Route(mv + "/infer", errors(server.infer), methods=["POST"]),
        *openai.OpenAI(server).routes(),
        *generate.routes(server, errors),
        *images.routes(server),  # /v1/images/generations over diffusion models
        *probes.routes(),
        *management.routes(errors),
        Route("/v2", server.server_metadata),
        Route("/openapi.json", server.openapi),
        Route("/v2/models/stats", errors(server.model_stats)),
        Route(m + "/rollout", errors(server.rollout_report)),
    ]
    for prefix in (m, mv):
        routes += [
            Route(prefix, errors(server.model_metadata)),
            Route(prefix + "/ready", server.model_ready),
            Route(prefix + "/config", errors(server.model_config)),
            Route(prefix + "/stats", errors(server.model_stats)),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(probes.watchdog())]
        if load:
            loading = asyncio.create_task(_load(repository, options))
            loading.add_done_callback(_log_failure)
            tasks.append(loading)
        yield
        for task in tasks:
            task.cancel()
        server.rollout.close()
        await repository.unload_all()

    return App(server, Router(routes=routes, lifespan=lifespan, default=_not_found))


def _log_failure(task: asyncio.Task) -> None:
    """A background task that dies says so (else the server would stay unready, silent)."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.error("%s failed", task.get_coro().__name__, exc_info=e)


async def _load(repository: Repository, options: ServerOptions) -> None:
    """Load what the model-control mode asks for, then (poll) keep the repository in sync."""
    started = time.perf_counter()
    if not repository.models:
        names = options.startup_models if options.model_control == "explicit" else None
        repository.scan(None if names is None or "*" in names else names)
    backends = {e.config.backend for e in repository.models.values() if e.config is not None}
    importing = time.perf_counter()
    await asyncio.to_thread(preimport, backends)
    import_seconds = time.perf_counter() - importing
    if options.lazy_load:
        repository.defer_all()
        log.info("lazy load: %s load on their first request", ", ".join(repository.lazy_models()))
        return
    await repository.load_all()
    log.info("repository loaded in %.2f s", time.perf_counter() - started)
    _report_startup(repository, options, import_seconds)
    _quiet_gc()
    while options.model_control == "poll":
        await asyncio.sleep(options.poll_seconds)
        try:
            await repository.poll()
        except Exception:
            log.exception("repository poll failed")
