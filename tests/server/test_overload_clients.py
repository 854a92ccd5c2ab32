"""Slow and hostile clients on a real server (bitserve/server/connections.py and the body
limits of admission.py, issue 35): connections that send their headers or body a byte at
a time are answered 408 and closed after their timeouts while other clients are served; a
stream nobody reads is cut after --write-timeout and its KV blocks come back; bodies past
the size or the memory bound get 413 or 503 before they are read."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, Server

CONFIG = """
backend = "llm"
[parameters]
max_model_len = 256
kv_cache_memory = 33554432
"""
MiB = 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients") / "models"
    shutil.copytree(ROOT / "models" / "tinylm" / "1", root / "tinylm" / "1")
    (root / "tinylm" / "config.toml").write_text(CONFIG)
    timeouts = ["--header-timeout", "1", "--body-timeout", "2", "--write-timeout", "1"]
    server = Server(root, *timeouts, "--max-body-memory", "128MiB")
    yield server
    server.stop()


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    samples = (s for f in text_string_to_metric_families(text) for s in f.samples)
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


async def slow_client(port: int, head: bytes, data: bytes, limit: float) -> tuple[bytes, float]:
    """Send `head`, then `data` a byte every 0.2 s until the server closes: (its answer,
    seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(head)
    answer = b""

    async def read() -> None:
        nonlocal answer
        while chunk := await reader.read(4096):
            answer += chunk

    reading = asyncio.create_task(read())
    try:
        for byte in data:
            if reading.done() or time.monotonic() - start > limit:
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.2)
        await asyncio.wait_for(reading, max(0.1, limit - (time.monotonic() - start)))
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
    return answer, time.monotonic() - start


def test_slow_headers_and_bodies_get_408_and_others_are_served(server):
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n"
    body = json.dumps({"model": "tinylm", "prompt": "x" * 400}).encode()

    async def normal() -> list[int]:
        answers = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(10):
                r = await client.post("/v1/completions", json={"model": "tinylm", "prompt": "In"})
                answers.append(r.status_code)
        return answers

    async def main():
        port, pad = server.port, b"X-Pad: " + b"a" * 200
        slow = [slow_client(port, b"", headers + pad, 10.0) for _ in range(100)]
        slow += [slow_client(port, headers + b"\r\n", body, 10.0) for _ in range(100)]
        return await asyncio.gather(normal(), *slow)

    served, *cut = asyncio.run(main())
    assert served == [200] * 10
    for answer, seconds in cut:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert seconds < 8.0  # closed by the server, not by the client's own limit
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


def test_a_stream_nobody_reads_is_cut_and_its_kv_freed(server):
    body = {"model": "tinylm", "messages": [{"role": "user", "content": "Who?"}], "n": 16}
    body |= {"max_tokens": 200, "ignore_eos": True, "stream": True}
    body |= {"logprobs": True, "top_logprobs": 20}  # ~1.5 KB a token: ~5 MB in all
    data = json.dumps(body).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    request += f"Content-Length: {len(data)}\r\n\r\n".encode() + data
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(request)
        running = lambda: metric(server, "bitserve_llm_num_requests_running")  # noqa: E731
        deadline = time.monotonic() + 60
        while not running() and time.monotonic() < deadline:  # the choices start
            time.sleep(0.1)
        while running() and time.monotonic() < deadline:  # reading nothing: they are cut
            time.sleep(0.2)
        # on a quiet box the engine may finish every choice before the 1 s write timeout
        # runs out: keep reading nothing past it, so the stalled writes are what ends it
        time.sleep(3)
        s.settimeout(10)
        received, closed = 0, True
        try:  # the bytes still buffered, then the end
            while chunk := s.recv(65536):
                received += len(chunk)
        except ConnectionResetError:
            pass
        except TimeoutError:
            closed = False
    # a finished stream would stay open (keep-alive): closed means cut, after `received`
    # bytes (its choices may have finished first: the kernel buffers megabytes)
    assert closed, f"the server kept a stream nobody read ({received} bytes)"
    assert metric(server, "bitserve_llm_num_requests_running") == 0
    assert metric(server, "bitserve_llm_kv_cache_usage_perc") == 0.0


def test_bodies_past_the_size_or_the_memory_bound_are_refused_before_they_are_read(server):
    def declared(length: int, path: bytes = b"/v2/models/tinylm/infer") -> socket.socket:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n")
        s.sendall(f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        return s

    def status(s: socket.socket) -> tuple[int, bytes]:
        answer = s.recv(4096)
        return int(answer.split()[1]), answer

    with declared(65 * MiB) as s:  # past --max-body-size (64 MiB)
        assert status(s)[0] == 413
    with declared(65 * MiB, b"/v1/chat/completions") as s:  # not held to be screened
        assert status(s)[0] == 413
    held = [declared(60 * MiB) for _ in range(2)]  # 120 of --max-body-memory's 128 MiB
    time.sleep(0.3)
    with declared(60 * MiB) as s:
        code, answer = status(s)
        assert code == 503 and b"retry-after: 1" in answer.lower(), answer
    for s in held:  # they never send their bodies: the body timeout answers them
        assert status(s)[0] == 408
        s.close()
    with declared(60 * MiB) as s:  # their bytes are given back
        s.sendall(b"{" * 1000)
        assert status(s)[0] == 408
