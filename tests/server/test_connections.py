"""The connection protocol's own parts (bitserve/server/connections.py) on a real uvicorn
server in this process, on both event loops (asyncio's and uvloop, which `bitserve serve`
runs): the client and server addresses in the ASGI scope come from the loop's transport
(not from sockets made again per connection), and the reading and keep-alive timeouts,
swept on one timer for all connections, close what they must and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import uvicorn
import uvloop

from bitserve.server.connections import ClientLimits, protocol
from tests.conftest import free_port

RUNNERS = {"asyncio": asyncio.run, "uvloop": uvloop.run}
GET = b"GET /where HTTP/1.1\r\nHost: x\r\n\r\n"


async def where(scope, receive, send):
    """Answers the scope's client and server addresses."""
    body = json.dumps({"client": scope["client"], "server": scope["server"]}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serving(limits: ClientLimits, keep_alive: float, check) -> None:
    """`check(port)` against a uvicorn server of `where` with `limits`."""
    port = free_port()
    config = uvicorn.Config(
        where,
        port=port,
        lifespan="off",
        log_level="warning",
        http=protocol(limits),
        timeout_keep_alive=keep_alive,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        await check(port)
    finally:
        server.should_exit = True
        await task


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return int(head.split()[1]), await reader.readexactly(length)


@pytest.mark.parametrize("loop", RUNNERS)
def test_the_scope_has_the_connections_addresses(loop):
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        status, body = await read_answer(reader)
        assert status == 200
        here = writer.get_extra_info("sockname")
        assert json.loads(body) == {"client": ["127.0.0.1", here[1]], "server": ["127.0.0.1", port]}
        writer.close()

    RUNNERS[loop](serving(ClientLimits(), 5, check))


@pytest.mark.parametrize("loop", RUNNERS)
def test_an_idle_keep_alive_connection_is_closed_without_a_408(loop):
    """Requests every 0.3 s keep the connection (each moves its deadline on); idle past
    the keep-alive timeout (0.5 s) it is closed, with nothing written."""

    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(5):
            writer.write(GET)
            assert (await read_answer(reader))[0] == 200
            await asyncio.sleep(0.3)
        start = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 5)
        assert rest == b""  # closed, no 408: it had been answered
        assert 0.15 <= time.monotonic() - start < 2.0  # 0.2 s of the 0.5 were gone already
        writer.close()

    RUNNERS[loop](serving(ClientLimits(header_timeout=1.0), 0.5, check))


@pytest.mark.parametrize("loop", RUNNERS)
def test_headers_not_in_within_the_header_timeout_get_a_408(loop):
    """Headers sent a line every 0.2 s: cut after header_timeout (0.6 s) with a 408,
    while a connection that sent its request in time is answered."""

    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        start = time.monotonic()
        writer.write(b"GET /where HTTP/1.1\r\n")
        answer = b""
        for i in range(20):
            if reader.at_eof():
                break
            writer.write(b"X-Pad-%d: a\r\n" % i)
            with contextlib.suppress(TimeoutError):
                answer += await asyncio.wait_for(reader.read(4096), 0.2)
        answer += await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert 0.6 <= time.monotonic() - start < 2.5
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        assert (await read_answer(reader))[0] == 200
        writer.close()

    RUNNERS[loop](serving(ClientLimits(header_timeout=0.6, body_timeout=5), 5, check))
