"""Servers for the bench tests: the deliberately slow one (known latencies)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

HERE = Path(__file__).resolve().parent
DELAY_MS, PREFILL_MS, TOKEN_MS = 80.0, 100.0, 20.0


def wait_http(url: str, process: subprocess.Popen, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: server exited {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{url}: not up in {limit} s")


def start_slow_server(*args: float | str) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, str(HERE / "slow_server.py"), "--port", str(port)]
    process = subprocess.Popen(command + [str(a) for a in args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", process)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="session")
def slow_server() -> Iterator[str]:
    """URL of tests/loadtest/slow_server.py answering after DELAY_MS / PREFILL_MS / TOKEN_MS."""
    yield from start_slow_server(
        "--delay-ms", DELAY_MS, "--prefill-ms", PREFILL_MS, "--token-ms", TOKEN_MS
    )


@pytest.fixture
def jittery_server() -> Iterator[str]:
    """A fresh slow server whose tokens take 2-12 ms, so streams finish out of order;
    its `/prompts` lists what it received."""
    yield from start_slow_server("--prefill-ms", 5, "--token-ms", 2, "--jitter-ms", 10)
