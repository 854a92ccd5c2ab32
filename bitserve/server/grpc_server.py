"""The v2 protocol over gRPC: KServe's GRPCInferenceService with the Triton additions
that tritonclient.grpc calls, and the standard grpc.health.v1 service for probes.

It runs in the HTTP server's process and event loop (grpcio's asyncio server), over the
same `ServerState`: the repository, the batchers, the traffic policies, the metrics and
the drain. Infer takes the one request path (`ModelVersion.start`), as HTTP does:

- a client deadline becomes the request's queue timeout, so a request whose deadline
  passes while it waits is dropped by the batcher and never runs;
- a call the client cancels (or whose deadline passes) takes its request off the queue;
  an LLM generation it started stops, and its KV blocks go back to the pool;
- errors become status codes through errors.py (`code_of`), the message naming the
  field; an error that says when to come back sends `retry-after` metadata.

This module is the gRPC plumbing only: the messages are decoded and encoded by the v2
codec HTTP uses too (bitserve/api/v2.py), and an LLM's tokens come from the one v2 token
stream (generate.text_stream).

ModelStreamInfer serves each request of the stream as it comes, concurrently; an LLM
model answers token by token (Triton's decoupled models; `"stream": false` in its
sampling_parameters asks for one response), every other model with one response. A
request that fails sends `error_message` and the stream goes on. When a request sets
`triton_enable_empty_final_response`, its responses carry `triton_final_response` and
an LLM's last one is empty, as Triton's.

Repository load and unload need the admin token as `authorization: Bearer <token>` call
metadata, as admin.py's HTTP routes do. Message sizes are capped by --max-body-size.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from bitserve import __version__, tracing
from bitserve.api import classification
from bitserve.api.proto import grpc_service_pb2 as pb
from bitserve.api.proto import grpc_service_pb2_grpc as pb_grpc
from bitserve.api.v2 import (
    config_message,
    encode_grpc_response,
    grpc_params,
    model_metadata,
    model_stats,
    parse_grpc_infer,
    stats_message,
    streams,
)
from bitserve.inference import ClientGone, InvalidRequest, text_inputs
from bitserve.repository.repository import ModelNotFound, ModelUnavailable
from bitserve.repository.version import ModelVersion, Ticket
from bitserve.server import admission, grpc_accept, shm
from bitserve.server.errors import EXPECTED, headers_of, status_of
from bitserve.server.generate import text_stream
from bitserve.server.record import Record
from bitserve.server.state import ServerState

log = logging.getLogger("bitserve.server")

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = [
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "system_shared_memory",
]
HEALTH_PERIOD_S = 0.25  # as health.py's watchdog
INFER = f"/{SERVICE}/ModelInfer"
ACCEPTORS = 64  # ModelInfer calls grpcio's core may hand over at once (grpc_accept)
GRACE_S = 5.0
FINAL = "triton_final_response"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Triton's codes for the HTTP statuses errors.py gives: the two protocols cannot disagree
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


async def start(state: ServerState) -> list[asyncio.Task]:
    """Bind and start the gRPC server when the options ask for one; the task it returns
    keeps the health service current and stops the server when cancelled. A port that
    cannot be bound fails here, so `bitserve serve` fails at start."""
    address = state.options.grpc_address
    if not address:
        return []
    limit = state.options.max_body
    interceptors = [Traced()] if tracing.enabled() else []
    server = grpc.aio.server(
        interceptors=interceptors or None,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a port another server holds fails here, as HTTP's does
        ],
    )
    service = Service(state)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(address)
    await server.start()
    infer = grpc.unary_unary_rpc_method_handler(
        service.ModelInfer,
        request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelInferResponse.SerializeToString,
    )
    acceptors = grpc_accept.accept_ahead(server, INFER, infer, interceptors, ACCEPTORS)
    log.info("gRPC on %s", address)
    return [asyncio.create_task(_run(server, health, state, acceptors))]


async def _run(
    server: grpc.aio.Server,
    health: health_aio.HealthServicer,
    state: ServerState,
    acceptors: asyncio.Task | None,
) -> None:
    helpers: set[int] = set()
    try:
        while True:
            yield_to_loop(helpers)
            ready = state.not_ready() is None
            for service in ("", SERVICE):
                await health.set(service, SERVING if ready else NOT_SERVING)
            for name in list(state.repository.models):
                await health.set(name, SERVING if ready and _ready(state, name) else NOT_SERVING)
            await asyncio.sleep(HEALTH_PERIOD_S)
    finally:
        await health.enter_graceful_shutdown()
        await server.stop(GRACE_S)
        if acceptors is not None:
            acceptors.cancel()


def yield_to_loop(done: set[int]) -> None:
    """Run grpcio's helper threads under SCHED_BATCH (Linux), those not yet in `done`:
    its event-engine pool (thread name `event_engine`) and the asyncio poller, which
    wakes for every completion to hand it to the event loop.

    With the default policy each of those wakeups preempts whatever holds the core, the
    event loop or a model thread, and gives it back a moment later: on a saturated core
    a streamed request cost 5.5 context switches. SCHED_BATCH only removes that wakeup
    preemption (a woken helper runs when the core's thread blocks or its slice ends), so
    completions pile up and are handed over together: 0.5 switches a request and ~15%
    more streamed requests a second (`python -m bench.grpc`). Threads the pool adds
    later are caught on the next call; one that cannot be changed is left as it is.
    """
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        tids = set(map(int, os.listdir("/proc/self/task")))
    except OSError:
        return
    done.intersection_update(tids)  # an ended thread's id may come back on a new one
    poller = {t.native_id for t in threading.enumerate() if t.name.endswith("(_poll_wrapper)")}
    unnamed = _thread_name(os.getpid())  # what a thread is called until it names itself
    for tid in tids - done:
        name = _thread_name(tid)
        if tid in poller or name == "event_engine":
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            done.add(tid)
        elif name is not None and name != unnamed:
            done.add(tid)  # named, and not grpc's: never look again


def _thread_name(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


class Traced(grpc.aio.ServerInterceptor):
    """Each call inside its tracing span (tracing.server_span), the child of the
    `traceparent` in its metadata; a stream's span lasts as long as the stream."""

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        carrier = dict(details.invocation_metadata or ())
        name = details.method.lstrip("/")
        attributes = {"rpc.system": "grpc", "rpc.method": name.rpartition("/")[2]}
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def traced_unary(request: Any, context: Any) -> Any:
                with tracing.server_span(name, carrier, attributes):
                    return await unary(request, context)

            return handler._replace(unary_unary=traced_unary)
        if handler.stream_stream is not None:
            stream = handler.stream_stream

            async def traced_stream(requests: Any, context: Any) -> AsyncIterator:
                with tracing.server_span(name, carrier, attributes):
                    async for response in stream(requests, context):
                        yield response

            return handler._replace(stream_stream=traced_stream)
        return handler


def _ready(state: ServerState, model: str, version: str | None = None) -> bool:
    try:
        state.repository.get(model, version)
    except (ModelNotFound, ModelUnavailable):
        return False
    return not state.draining


def code_of(exc: BaseException) -> grpc.StatusCode:
    return CODES.get(status_of(exc), grpc.StatusCode.INTERNAL)


def rpc(method: Callable) -> Callable:
    """A unary method whose exceptions end the call with their status code."""

    @functools.wraps(method)
    async def wrapped(self: Service, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code = code_of(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, EXPECTED):
        log.exception("internal error on a gRPC call", exc_info=exc)
    metadata = tuple((k.lower(), v) for k, v in (headers_of(exc) or {}).items())
    await context.abort(code, _message(exc), metadata)


def _message(exc: BaseException) -> str:
    if status_of(exc) == 500:
        return f"{type(exc).__name__}: {exc}"
    return str(exc) or type(exc).__name__


class Service(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState):
        self.state = state
        self.repository = state.repository

    # ---------------------------------------------------------------- health

    @rpc
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=not self.state.problems())

    @rpc
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.not_ready() is None)

    @rpc
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        ready = _ready(self.state, request.name, request.version or None)
        return pb.ModelReadyResponse(ready=ready)

    # -------------------------------------------------------------- metadata

    @rpc
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="bitserve", version=__version__, extensions=EXTENSIONS
        )

    @rpc
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        version = self.repository.get(request.name, request.version or None)
        entry = self.repository.entry(version.config.name)
        return pb.ModelMetadataResponse(**model_metadata(version, entry))

    @rpc
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        version = self.repository.get(request.name, request.version or None)
        return pb.ModelConfigResponse(config=config_message(version))

    @rpc
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        stats = model_stats(self.repository, request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[stats_message(s) for s in stats])

    # ------------------------------------------------------------ repository

    @rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        self._admin(context)
        models = [
            pb.RepositoryIndexResponse.ModelIndex(**m)
            for m in self.repository.index()
            if not request.ready or m["state"] == "READY"
        ]
        return pb.RepositoryIndexResponse(models=models)

    @rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        self._admin(context, change=True)
        if request.parameters:
            raise InvalidRequest(
                f"load parameters {sorted(request.parameters)} are not supported: edit "
                "config.toml and the version folders, then load"
            )
        await self.repository.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        self._admin(context, change=True)
        await self.repository.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _admin(self, context: Any, change: bool = False) -> None:
        """admin.py's guard, with the token in the call's metadata."""
        self.state.authorize(dict(context.invocation_metadata() or ()).get("authorization", ""))
        if change:
            self.state.allow_changes()

    # --------------------------------------------------------- shared memory

    @rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.state.shm.status(request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
            )
        return response

    @rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        self.state.shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        self.state.shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        if request.name:
            raise InvalidRequest(f"no CUDA shared memory region '{request.name}' is registered")
        return pb.CudaSharedMemoryStatusResponse()

    @rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        raise shm.refuse_cuda()

    @rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self._shm_admin(context)
        return pb.CudaSharedMemoryUnregisterResponse()

    def _shm_admin(self, context: Any) -> None:
        """shm.py's admin rules, with the peer and the token from the call."""
        peer = context.peer() or ""  # ipv4:127.0.0.1:5000, ipv6:[::1]:5000, unix:...
        host = "" if peer.startswith("unix:") else peer.partition(":")[2].rpartition(":")[0]
        token = dict(context.invocation_metadata() or ()).get("authorization", "")
        shm.authorize(self.state, host.strip("[]"), token)

    # ----------------------------------------------------------------- infer

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self.state.enter()
        try:
            version, route = await self._route(request)
            return await self._infer(version, route, request, context)
        finally:
            self.state.leave()

    async def _route(self, request: pb.ModelInferRequest) -> tuple[ModelVersion, Any]:
        routed = self._route_now(request)
        if routed is not None:
            return routed
        await self.repository.ensure_loaded(request.model_name)
        # no await from here to the queue (v2.py's infer says why)
        return self.state.route_model(request.model_name, request.model_version or None)

    def _route_now(self, request: pb.ModelInferRequest) -> tuple[ModelVersion, Any] | None:
        """`_route` without its await: None for a lazy model, whose load must be awaited
        (`ensure_loaded` returns at once for every other model)."""
        if not request.model_name:
            raise InvalidRequest("field 'model_name' is required")
        entry = self.repository.models.get(request.model_name)
        if entry is not None and entry.lazy():
            return None
        return self.state.route_model(request.model_name, request.model_version or None)

    async def _infer(
        self, version: ModelVersion, route: Any, request: pb.ModelInferRequest, context: Any
    ) -> pb.ModelInferResponse:
        """v2.py's `_infer` for gRPC: the same bookkeeping (record.py)."""
        ticket, record = self._begin(version, route, request, context)
        try:
            outputs = await ticket.result
        except asyncio.CancelledError as exc:  # the client cancelled, or its deadline passed
            ticket.cancel(ClientGone("the client cancelled the call"))
            record.close(exc)
            raise
        except BaseException as exc:
            record.close(exc)
            raise
        return self._answer(version, record, outputs)

    def _begin(
        self, version: ModelVersion, route: Any, request: pb.ModelInferRequest, context: Any
    ) -> tuple[Ticket, Record]:
        """Parse the request and start it; its record runs from here, closed here if
        it fails to start, else by `_answer` or by whoever gives up on its result."""
        record = Record(self.state, version, route)
        try:
            admission.check(version)  # a full LLM queue refuses before the parse
            remaining = context.time_remaining()
            record.parsed = parse_grpc_infer(version.config, request, remaining, self.state.shm)
            ticket = version.start(record.parsed)
        except BaseException as exc:
            record.close(exc)
            raise
        record.job = ticket.job
        return ticket, record

    def _answer(
        self,
        version: ModelVersion,
        record: Record,
        outputs: dict,
        into: pb.ModelInferResponse | None = None,
    ) -> pb.ModelInferResponse:
        """The response to a started request whose outputs came (written `into` a
        message when given); closes the request's record."""
        try:
            record.outputs = outputs
            answer = classification.apply(version, record.parsed, outputs)
            response = encode_grpc_response(
                version.config.name, version.version, record.parsed, answer, into, self.state.shm
            )
        except BaseException as exc:
            record.close(exc)
            raise
        record.close(None)
        return response

    # ---------------------------------------------------------------- stream

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request starts as soon as it is read, and is answered as soon as it is
        done, in whatever order (a `_Stream`); the call ends once reading is over and
        every request is answered."""
        stream = _Stream(self, context)
        reader = asyncio.create_task(stream.read(context))
        items, loop = stream.items, asyncio.get_running_loop()
        try:
            while True:
                while not items:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                stream.waiter = None
                item = items.popleft()
                if item is END:
                    break
                yield item
            reader.result()  # a broken request stream ends the call with its error
        finally:
            reader.cancel()
            stream.close()

    async def _stream_one(
        self, request: pb.ModelInferRequest, context: Any, stream: _Stream
    ) -> None:
        """A stream's request that needs its own task: an LLM generation, or a lazy
        model's first load. The caller entered the server state for it."""
        final = _final(request)
        try:
            version, route = await self._route(request)
            if version.serves("generate") and streams(request):
                async for response in self._generate(version, request, context, final):
                    stream.put(pb.ModelStreamInferResponse(infer_response=response))
            else:
                response = await self._infer(version, route, request, context)
                if final:
                    response.parameters[FINAL].bool_param = True
                stream.put(pb.ModelStreamInferResponse(infer_response=response))
        except Exception as exc:
            stream.put(_stream_error(exc))
        finally:
            self.state.leave()

    async def _generate(
        self, version: ModelVersion, request: pb.ModelInferRequest, context: Any, final: bool
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """The v2 token stream (generate.text_stream) as gRPC responses: one per new
        piece of text, then, when the client asks for it, an empty final one."""
        parsed = parse_grpc_infer(version.config, request, context.time_remaining())
        name, number = version.config.name, version.version
        async with contextlib.aclosing(text_stream(version, *text_inputs(parsed.inputs))) as pieces:
            async for delta, _ in pieces:
                if delta or not final:
                    text = np.array([delta.encode()], dtype=object)
                    response = encode_grpc_response(name, number, parsed, {"text_output": text})
                    if final:
                        response.parameters[FINAL].bool_param = False
                    yield response
        if final:
            last = pb.ModelInferResponse(model_name=name, model_version=str(number))
            last.parameters[FINAL].bool_param = True
            if parsed.id is not None:
                last.id = parsed.id
            yield last


END = object()  # a stream's last queue item: no request is left to answer


class _Stream:
    """One ModelStreamInfer call: its requests in flight and its responses' queue.

    A request for a loaded model that does not stream tokens (every batched model's)
    costs no task: it is parsed and queued as soon as it is read, and its result's
    done-callback answers it, as `ModelInfer` does after its await. The others (an LLM
    generation, a lazy model's load) run as tasks. Closing the stream cancels both
    kinds: a queued request leaves the queue, a generation frees its KV."""

    def __init__(self, service: Service, context: Any):
        self.service, self.context = service, context
        self.items: deque = deque()  # the responses, END last; the call's writer waits
        self.waiter: asyncio.Future | None = None  # on `waiter` while there is none
        self.tasks: set[asyncio.Task] = set()
        # a started request's result future -> (version, ticket, record, final)
        self.pending: dict[asyncio.Future, tuple[ModelVersion, Ticket, Record, bool]] = {}
        self.reading = True

    def put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self, context: grpc.aio.ServicerContext) -> None:
        """Start each request as it is read (`context.read()`: the request iterator's
        own loop, less an async generator's step per message)."""
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                self.start(request)
        finally:
            self.reading = False
            self._check_end()

    def start(self, request: pb.ModelInferRequest) -> None:
        service = self.service
        state = service.state
        try:
            state.enter()
        except Exception as exc:
            return self.put(_stream_error(exc))
        try:
            routed = service._route_now(request)
            if routed is None or (routed[0].serves("generate") and streams(request)):
                task = asyncio.create_task(service._stream_one(request, self.context, self))
                self.tasks.add(task)
                task.add_done_callback(self._task_done)
                return
            version, route = routed
            ticket, record = service._begin(version, route, request, self.context)
        except BaseException as exc:
            state.leave()
            if not isinstance(exc, Exception):
                raise
            return self.put(_stream_error(exc))
        final = _final(request)
        self.pending[ticket.result] = (version, ticket, record, final)
        ticket.result.add_done_callback(self._answer)

    def _answer(self, result: asyncio.Future) -> None:
        version, _, record, final = self.pending.pop(result)
        service = self.service
        try:
            if result.cancelled():
                record.close(asyncio.CancelledError())
                return
            error = result.exception()
            if error is not None:
                record.close(error)
                self.put(_stream_error(error))
                return
            message = pb.ModelStreamInferResponse()
            try:
                response = service._answer(version, record, result.result(), message.infer_response)
            except Exception as exc:
                self.put(_stream_error(exc))
                return
            if final:
                response.parameters[FINAL].bool_param = True
            self.put(message)
        finally:
            service.state.leave()
            self._check_end()

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self._check_end()

    def _check_end(self) -> None:
        if not self.reading and not self.tasks and not self.pending:
            self.put(END)

    def close(self) -> None:
        """The call is over (done, or the client left): stop whatever still runs."""
        for task in self.tasks:
            task.cancel()
        pending, self.pending = self.pending, {}
        for result, (_, ticket, record, _) in pending.items():
            result.remove_done_callback(self._answer)
            result.cancel()
            ticket.cancel(ClientGone("the client cancelled the call"))
            record.close(asyncio.CancelledError())
            self.service.state.leave()


def _stream_error(exc: BaseException) -> pb.ModelStreamInferResponse:
    """A failed request's answer on a stream, which goes on."""
    if code_of(exc) == grpc.StatusCode.INTERNAL and not isinstance(exc, EXPECTED):
        log.exception("internal error in a gRPC stream", exc_info=exc)
    return pb.ModelStreamInferResponse(error_message=_message(exc))


def _final(request: pb.ModelInferRequest) -> bool:
    """Whether the client asks for an empty last response (tritonclient's
    `enable_empty_final_response`)."""
    return grpc_params(request.parameters).get("triton_enable_empty_final_response") is True
