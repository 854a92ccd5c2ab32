"""How long one HTTP connection may take to send a request or to read a response
(issue 35: slow and hostile clients).

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but any byte that
arrives resets that timer, and nothing times a request being read or a response being
written: a client that sent its headers or its body a byte a second (slowloris) held its
connection for ever, and one that never read its stream held the response's task, its
version lease (a drain waited on it) and, until its last token, its KV blocks.

`protocol(limits)` is uvicorn's httptools protocol with three timeouts, each of which
closes the connection when it runs out (the reading ones and uvicorn's keep-alive are
swept on one timer for all connections, `_Sweep`, up to a quarter of the shortest late):

- `header_timeout`: from a request's first byte (or the connection's opening) to the
  end of its headers;
- `body_timeout`: from the end of the headers to the end of the body;
- `write_timeout`: the socket's send buffer full (the client reads nothing) that long.

A request whose reading timed out gets 408 first when nothing was answered yet. The app
sees the client leave, as for a disconnect: a stream stops, its engine requests are
aborted and their KV blocks return to the pool.

The protocol also refuses under overload before an ASGI task exists (issue 35: a 429
within 50 ms while the engine is saturated): when a request's headers are in, `admission`
(admission.Admission) says whether it is refused now (a v2 infer on a full LLM queue),
or, for OpenAI generation whose model is in the body, once a body of up to 64 KiB is in
(the task starts then; a larger one, or one that waits for `100 Continue`, is started at
once and screened by the ASGI app as before). A refusal is written to the transport as
bytes: no task, no ASGI messages, no Starlette response sent through uvicorn's cycle; the
rest of a refused body is read and dropped, and the connection serves on (keep-alive,
pipelining).
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import weakref
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("bitserve.server")
FIRST_CHUNK_LIMIT = 64 * 1024  # a larger OpenAI body is not held back to be screened
DOOR = "bitserve.door"  # scope key: the queue place admission holds for a request it let through
TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass
class ClientLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    write_timeout: float = 30.0


def protocol(limits: ClientLimits, admission: Any = None) -> type:
    """uvicorn's httptools protocol class with `limits` (uvicorn.Config's `http`), that
    lets `admission` (admission.Admission) refuse a request before its ASGI task exists."""
    from uvicorn.logging import TRACE_LOG_LEVEL
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    sweeps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # uvicorn's ServerState's
    tick = min(1.0, limits.header_timeout / 4, limits.body_timeout / 4)  # and keep-alive's

    class TimedProtocol(HttpToolsProtocol):
        _due: float | None = None  # when the connection is closed (loop time), unless moved
        _idle = False  # _due is the keep-alive timeout (no 408)
        _sweep: _Sweep | None = None  # the server's sweep of the connections due
        _writing: asyncio.TimerHandle | None = None
        _held: tuple | None = None  # a cycle whose start waits for its body

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            """Refused here, when admission can say so now: no task, no ASGI messages."""
            if admission is not None and cycle.scope["method"] == "POST":
                try:
                    if self._screened(cycle, app):
                        return
                except Exception:  # a bug here must not cost the request: the app decides
                    log.exception("screening %s", cycle.scope["path"])
            super()._start_asgi_task(cycle, app)

        def _screened(self, cycle: Any, app: Any) -> bool:
            """True when the request was refused, or is held until its body is in."""
            body = None
            if admission.needs_body(cycle.scope):
                if cycle.more_body and not cycle.waiting_for_100_continue:
                    self._held = (cycle, app)  # the body is on its way: decide once it is in
                    return True
                body = bytes(cycle.body) if not cycle.more_body else None
            refusal = admission.door(cycle.scope, body)
            if refusal is not None:
                self._refuse(cycle, refusal)
            return refusal is not None

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            held = self._held
            if held is not None and len(held[0].body) > FIRST_CHUNK_LIMIT:
                self._held = None  # chunked, grown too large to screen: the app reads on
                super()._start_asgi_task(*held)

        def _refuse(self, cycle: Any, response: Any) -> None:
            self.transport.write(_wire(response, cycle.keep_alive))
            cycle.response_started = cycle.response_complete = True  # the rest of a body is dropped
            # what uvicorn's run_asgi does as it ends: the cycle's `on_response` is this
            # protocol's bound method, and the protocol keeps its last cycle; left, every
            # connection closed after a refusal was a dozen objects (protocol, transport,
            # flow control, events) that only the garbage collector freed, and its
            # collections of tens of thousands of them took 80-540 ms of the event loop
            cycle.on_response = _nothing
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()

        def connection_made(self, transport: Any) -> None:
            """uvicorn's, but with the addresses the event loop took at the accept
            (get_extra_info): uvicorn's own helpers wrap the socket in two Python socket
            objects and ask the kernel again, 5 syscalls a connection (issue 35: a burst
            of 400 new clients is the loop's CPU before anything else)."""
            self.connections.add(self)
            self.transport = transport
            self.flow = FlowControl(transport)
            self.server = _address(transport.get_extra_info("sockname"))
            self.client = _address(transport.get_extra_info("peername"))
            self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
            if self.logger.level <= TRACE_LOG_LEVEL:
                prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
                self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", prefix)
            self._due_within(limits.header_timeout)  # a connection that sends nothing

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._due_within(limits.header_timeout)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._due_within(limits.body_timeout)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._due = None
            if self._held is not None:
                held, self._held = self._held, None
                self._start_asgi_task(*held)

        def on_response_complete(self) -> None:
            """uvicorn's, with its keep-alive timeout swept as the reading ones (_Sweep)."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self.flow.resume_reading()
            if self.pipeline:
                self._start_asgi_task(*self.pipeline.pop())
            else:
                self._due_within(self.timeout_keep_alive, idle=True)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._writing is None:
                self._writing = self.loop.call_later(limits.write_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._writing is not None:
                self._writing.cancel()
                self._writing = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._held = self._due = None
            self.resume_writing()
            super().connection_lost(exc)

        def _due_within(self, seconds: float, idle: bool = False) -> None:
            """Close the connection in `seconds` unless a request's reading moves on
            (idle: a keep-alive connection between requests, closed without a 408)."""
            self._due, self._idle = self.loop.time() + seconds, idle
            sweep = self._sweep
            if sweep is None:
                sweep = self._sweep = sweeps.get(self.server_state)
                if sweep is None:
                    every = min(tick, self.timeout_keep_alive / 4)
                    sweep = sweeps[self.server_state] = _Sweep(self.loop, self.connections, every)
            if sweep.timer is None:
                sweep.arm()

        def _expire(self) -> None:
            self._due = None
            if not self._idle:
                self._late()
            elif not self.transport.is_closing():
                self.transport.close()

        def _late(self) -> None:
            """The request did not arrive in time: 408 unless answered, then close."""
            self._due = None
            cycle: Any = self.cycle
            if cycle is None or not cycle.response_started:
                self.transport.write(TIMEOUT_408)
            if cycle is not None:
                cycle.keep_alive = False
            self.transport.close()

        def _stalled(self) -> None:
            """The client read nothing for write_timeout: drop the connection (close
            would wait for a buffer that never drains)."""
            self._writing = None
            self.transport.abort()

    return TimedProtocol


class _Sweep:
    """The reading and keep-alive timeouts of a server's connections, on one timer.

    A connection notes when it is due (`_due`, loop time) as a request's reading moves
    on; the sweep closes those past it every `tick` seconds while any is due (up to a
    tick late). A timer of its own per connection was 4-5 a request, each made and
    cancelled (1.7 us and 4 objects for the garbage collector a connection, issue 35:
    a burst of 400 new clients costs the loop before anything else)."""

    def __init__(self, loop: Any, connections: set, tick: float):
        self.loop, self.connections, self.tick = loop, connections, tick
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        self.timer = self.loop.call_later(self.tick, self.run)

    def run(self) -> None:
        self.timer = None
        now, pending = self.loop.time(), False
        for connection in tuple(self.connections):
            due = getattr(connection, "_due", None)  # the set holds websockets too
            if due is None:
                continue
            if due <= now:
                try:
                    connection._expire()
                except Exception:  # one connection's failure must not stop the sweep
                    log.exception("closing a connection past its timeout")
            else:
                pending = True
        if pending:
            self.arm()


def _address(info: Any) -> tuple[str, int | None] | None:
    """uvicorn's (host, port) of a socket address: (path, None) for a Unix socket."""
    if type(info) is tuple and len(info) == 2 and type(info[0]) is str and type(info[1]) is int:
        return info  # IPv4, as the loop gives it: no new tuple
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return (info, None) if isinstance(info, str) and info else None


def _nothing() -> None:
    pass


_WIRE: dict[tuple[Any, bool], bytes] = {}  # a response's bytes (admission reuses responses)


def _wire(response: Any, keep_alive: bool) -> bytes:
    """`response` as HTTP/1.1 bytes, formatted once per response object."""
    data = _WIRE.get((response, keep_alive))
    if data is None:
        head = [b"HTTP/1.1 %d %s\r\n" % (response.status_code, _reason(response.status_code))]
        head += [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
        if not keep_alive:
            head.append(b"connection: close\r\n")
        if len(_WIRE) >= 128:  # holds the responses too: a few distinct ones at a time
            _WIRE.clear()
        data = _WIRE[(response, keep_alive)] = b"".join(head) + b"\r\n" + response.body
    return data


@functools.cache
def _reason(status: int) -> bytes:
    return http.HTTPStatus(status).phrase.encode("latin-1")
