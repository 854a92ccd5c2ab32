"""bench/server.py: a server that stays up but will never be ready is given up on as
soon as its log says so, not after the whole start-up timeout."""

from __future__ import annotations

import sys
import time

import pytest

from bench.server import Server, free_port

STAYS_UP = (
    "import time; print('loading ended, NOT ready: model failed', flush=True); time.sleep(60)"
)


def test_a_server_that_logs_it_will_not_be_ready_fails_at_once():
    server = Server("stuck", [sys.executable, "-c", STAYS_UP], free_port(), "/ready",
                    timeout=50, fails_with="NOT ready")  # fmt: skip
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="will not be ready"):
        server.start()
    assert time.monotonic() - began < 20
    assert not server.alive()


def test_without_the_marker_it_waits_for_the_timeout():
    server = Server("stuck", [sys.executable, "-c", STAYS_UP], free_port(), "/ready", timeout=2)
    with pytest.raises(RuntimeError, match="not ready after 2 s"):
        server.start()
