"""Unary calls of one gRPC method accepted ahead, so that a burst reaches the loop together.

grpc.aio's server asks its core for the next call of a method only once the last one
has reached the event loop: on one busy core each unary call costs a round trip through
grpcio's poller thread before the next is even accepted, so calls trickle in one per
loop wakeup, each finds the model idle and runs alone (1.2 rows a batch of the mlp at
c = 64), and a no-op ModelInfer costs ~400 us of the server a call (15 context
switches, on a loaded 2-core box). With `n` calls requested ahead, a burst completes in
one poller batch and the loop starts its handlers in one iteration: the no-op call
costs ~220 us (6 switches), twice the calls a second, and the mlp runs ~14 rows a batch
(`python -m bench.grpc`). 32, 64 and 128 ahead measured alike at c = 64.

This drives grpcio's own per-call machinery (cygrpc's `_request_registered_call`,
`_handle_rpc`, `_schedule_rpc_coro`: what its `_server_main_loop` runs for each call),
so interceptors, tracing, deadlines, cancellation and status codes behave as grpcio's
own accept loop makes them. Those names are private to grpcio, which is why they live
here alone: on a grpcio without them (or with other signatures) nothing is requested
ahead, the server runs as grpcio does, and a warning says so
(tests/server/test_grpc.py then fails its batching check).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

log = logging.getLogger("bitserve.server")


def accept_ahead(
    server: grpc.aio.Server,
    method: str,
    handler: grpc.RpcMethodHandler,
    interceptors: list,
    n: int,
) -> asyncio.Task | None:
    """Keep `n` more calls of `method` (its full name, "/package.Service/Method")
    requested from the started `server`'s core than grpcio's own one, each served by
    `handler` through `interceptors`. The task ends when the server shuts down (which
    fails the calls still requested); None when grpcio lacks what this needs."""
    try:
        from grpc._cython import cygrpc

        core = server._server  # cygrpc.AioServer
        request_call = core._request_registered_call
        handle, schedule = cygrpc._handle_rpc, cygrpc._schedule_rpc_coro
        resolver = cygrpc._MethodResolver([], {method: handler})
        if (handle.__code__.co_argcount, schedule.__code__.co_argcount) != (6, 4):
            raise TypeError("cygrpc's _handle_rpc or _schedule_rpc_coro changed")
    except (ImportError, AttributeError, TypeError) as exc:
        log.warning("gRPC: %s calls are accepted one at a time (%s)", method, exc)
        return None
    loop = asyncio.get_running_loop()
    name, chain, calls = method.encode(), tuple(interceptors), set()

    async def acceptor() -> None:
        while True:
            try:
                rpc_state = await request_call(name)
            except Exception:  # the server is shutting down: no call is pending
                return
            coro = handle(method, resolver, chain, rpc_state, loop, False)
            call = loop.create_task(schedule(coro, rpc_state, loop, method))
            calls.add(call)  # the loop keeps a task only weakly
            call.add_done_callback(calls.discard)

    async def accept() -> None:
        await asyncio.gather(*(acceptor() for _ in range(n)))

    return asyncio.create_task(accept())
