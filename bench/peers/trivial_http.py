"""Trivial HTTP servers that do no work: they measure the load generator, not a server.

`--kind asgi`: a raw ASGI app under uvicorn (httptools + uvloop), the fastest a
uvicorn-based server can answer. `--kind canned`: an asyncio protocol (uvloop) that
answers every request on a keep-alive connection with the same pre-built bytes, far
cheaper than any real server. If a client cannot saturate these by a wide margin, it
would be the bottleneck in the no-op comparison.
"""

from __future__ import annotations

import argparse
import asyncio

BODY = b'{"y":[1.0,2.0,3.0,4.0]}'
CANNED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)


async def asgi_app(scope, receive, send):
    """Read the whole body, answer a fixed JSON document."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


class CannedProtocol(asyncio.Protocol):
    """Answers each complete request (headers + Content-Length body) with CANNED."""

    def connection_made(self, transport):
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in bytes(self.buf[:end]).lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[: end + 4 + length]
            self.transport.write(CANNED)


async def serve_canned(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(CannedProtocol, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", choices=["asgi", "canned"], default="asgi")
    args = parser.parse_args()
    if args.kind == "asgi":
        import uvicorn

        uvicorn.run(
            asgi_app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False
        )
    else:
        import uvloop

        uvloop.run(serve_canned(args.port))


if __name__ == "__main__":
    main()
