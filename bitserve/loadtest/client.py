"""A minimal HTTP/1.1 client on raw asyncio: the load generator's side of the wire.

A benchmark client must cost far less per request than the server it measures, or it
measures itself. aiohttp spends ~10x more CPU per request than this on one core here, so
requests are built once as bytes and written as is, and responses are parsed only as far
as needed: the status line, Content-Length or chunked framing, and (for streams) the
arrival time of every body piece, so time to first token and inter-token gaps are seen
as the socket delivers them.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# on_data(bytes, arrival perf_counter time): called for each piece of a response body.
OnData = Callable[[bytes, float], None]


class ConnectionLost(Exception):
    """The server closed the connection before the response was complete."""


class StaleConnection(ConnectionLost):
    """A reused keep-alive connection was closed before any byte of the answer came.

    The server closed it between requests (some, like llama.cpp's, close after each
    streamed answer, and the close can arrive just after the client reused it), so the
    request was never processed; clients retry such a request on a new connection."""


def build_request(host: str, path: str, body: bytes, method: str = "POST") -> bytes:
    """A complete keep-alive HTTP/1.1 request, built once and written as is."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
    if method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


class Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time.

    `request` writes the bytes and returns (status, body). With `on_data`, body pieces go
    to it as they arrive instead of being collected, and the returned body is empty.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.closed = False
        self.answered = 0  # complete responses on this connection

    # ------------------------------------------------------------ public

    async def request(
        self, raw: bytes, on_data: OnData | None = None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        """Send `raw`, await the whole response; TimeoutError (and a closed connection,
        since its half-read response cannot be reused) after `timeout` seconds."""
        if self.closed:
            raise StaleConnection("connection closed")
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.buf, self.body, self.status, self.on_data = bytearray(), bytearray(), 0, on_data
        self.state, self.need, self.first_byte = "head", 0, 0.0
        timer = loop.call_later(timeout, self._expire) if timeout else None
        self.transport.write(raw)
        try:
            return await self.done
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        if not self.done.done():
            self.done.set_exception(TimeoutError("no complete response in time"))
            self.close()
            self.closed = True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            stale = self.answered and not self.first_byte
            lost = StaleConnection if stale else ConnectionLost
            self.done.set_exception(lost(str(exc or "closed by server")))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.first_byte:
            self.first_byte = now
        self.buf += data
        while self.buf and self.done is not None and not self.done.done():
            if not self._step(now):
                return

    # ------------------------------------------------------------ parsing

    def _step(self, now: float) -> bool:
        """Consume what the current state can from `buf`; False when it needs more bytes."""
        if self.state == "head":
            return self._head()
        if self.state == "length":
            return self._fixed(now)
        if self.state == "size":
            return self._chunk_size()
        return self._chunk_data(now)

    def _head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        self.status = int(lines[0].split(b" ", 2)[1])
        self.state, self.need = "length", 0
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            key = key.strip().lower()
            if key == b"content-length":
                self.need = int(value)
            elif key == b"transfer-encoding" and b"chunked" in value.lower():
                self.state = "size"
        if self.state == "length" and self.need == 0:
            self._finish()
        return True

    def _fixed(self, now: float) -> bool:
        piece = bytes(self.buf[: self.need])
        del self.buf[: len(piece)]
        self.need -= len(piece)
        self._deliver(piece, now)
        if self.need == 0:
            self._finish()
        return self.need == 0

    def _chunk_size(self) -> bool:
        end = self.buf.find(b"\r\n")
        if end < 0:
            return False
        size = int(bytes(self.buf[:end]).split(b";")[0], 16)
        if size == 0:  # last chunk: expect the final CRLF (no trailers from our peers)
            if len(self.buf) < end + 4:
                return False
            del self.buf[: end + 4]
            self._finish()
            return True
        del self.buf[: end + 2]
        self.state, self.need = "data", size + 2  # the chunk and its CRLF
        return True

    def _chunk_data(self, now: float) -> bool:
        take = min(self.need, len(self.buf))
        piece = bytes(self.buf[:take])
        del self.buf[:take]
        self.need -= take
        self._deliver(piece[: max(0, len(piece) - max(0, 2 - self.need))], now)
        if self.need == 0:
            self.state = "size"
            return True
        return False

    def _deliver(self, piece: bytes, now: float) -> None:
        if not piece:
            return
        if self.on_data is not None:
            self.on_data(piece, now)
        else:
            self.body += piece

    def _finish(self) -> None:
        self.state = "head"
        self.answered += 1
        self.done.set_result((self.status, bytes(self.body)))


async def connect(host: str, port: int) -> Connection:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(Connection, host, port)
    conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class Pool:
    """Idle keep-alive connections to one server; a new one is opened when none is idle."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = parts.netloc
        self.idle: list[Connection] = []

    async def get(self) -> Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return await self.fresh()

    async def fresh(self) -> Connection:
        return await connect(self.host, self.port)

    def put(self, conn: Connection) -> None:
        if not conn.closed:
            self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
