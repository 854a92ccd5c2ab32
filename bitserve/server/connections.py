"""How long one HTTP connection may take to send a request or to read a response
(issue 35: slow and hostile clients).

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but any byte that
arrives resets that timer, and nothing times a request being read or a response being
written: a client that sent its headers or its body a byte a second (slowloris) held its
connection for ever, and one that never read its stream held the response's task, its
version lease (a drain waited on it) and, until its last token, its KV blocks.

`protocol(limits)` is uvicorn's httptools protocol with three timers, each of which
closes the connection when it runs out:

- `header_timeout`: from a request's first byte (or the connection's opening) to the
  end of its headers;
- `body_timeout`: from the end of the headers to the end of the body;
- `write_timeout`: the socket's send buffer full (the client reads nothing) that long.

A request whose reading timed out gets 408 first when nothing was answered yet. The app
sees the client leave, as for a disconnect: a stream stops, its engine requests are
aborted and their KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass
class ClientLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    write_timeout: float = 30.0


def protocol(limits: ClientLimits) -> type:
    """uvicorn's httptools protocol class with `limits` (uvicorn.Config's `http`)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedProtocol(HttpToolsProtocol):
        _reading: asyncio.TimerHandle | None = None
        _writing: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._read_within(limits.header_timeout)  # a connection that sends nothing

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._read_within(limits.header_timeout)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._read_within(limits.body_timeout)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._read_within(None)

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
            self._read_within(None)
            self.resume_writing()
            super().connection_lost(exc)

        def _read_within(self, seconds: float | None) -> None:
            if self._reading is not None:
                self._reading.cancel()
            self._reading = None if seconds is None else self.loop.call_later(seconds, self._late)

        def _late(self) -> None:
            """The request did not arrive in time: 408 unless answered, then close."""
            self._reading = None
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
