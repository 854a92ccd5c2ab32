"""bitserve/server/shm.py's rules without a server: who may manage regions (the admin
token, else a loopback peer), which keys it opens (a name in /dev/shm only), and the
bounds every tensor is checked against. Regions are made by the standard library's
multiprocessing.shared_memory, as tritonclient's helpers make them."""

from __future__ import annotations

from multiprocessing import shared_memory

import pytest

from bitserve.inference import InvalidRequest
from bitserve.metrics import Metrics
from bitserve.repository.repository import Repository
from bitserve.server import shm
from bitserve.server.errors import Forbidden, Unauthorized
from bitserve.server.state import ServerOptions, ServerState


def state(tmp_path, token: str | None) -> ServerState:
    return ServerState(Repository(tmp_path), ServerOptions(admin_token=token), Metrics())


def test_without_a_token_only_loopback_peers_manage_regions(tmp_path):
    server = state(tmp_path, None)
    for peer in ("127.0.0.1", "::1", ""):  # "": a unix socket
        shm.authorize(server, peer, "")
    with pytest.raises(Forbidden, match="own host"):
        shm.authorize(server, "10.1.2.3", "")


def test_with_a_token_every_peer_needs_it(tmp_path):
    server = state(tmp_path, "t0ken")
    shm.authorize(server, "10.1.2.3", "Bearer t0ken")
    with pytest.raises(Unauthorized):
        shm.authorize(server, "127.0.0.1", "")
    with pytest.raises(Unauthorized):
        shm.authorize(server, "127.0.0.1", "Bearer wrong")


@pytest.mark.parametrize("key", ["../etc/passwd", "/a/b", "", ".", "/..", "x\x00y"])
def test_a_key_that_is_not_a_plain_name_is_refused(key):
    with pytest.raises(InvalidRequest, match="field 'key'"):
        shm.SharedMemory().register("r", key, 0, 8)


@pytest.fixture
def block():
    memory = shared_memory.SharedMemory(create=True, size=4096)
    yield memory
    memory.close()
    memory.unlink()


def test_a_window_is_checked_against_the_object_then_every_tensor_against_the_window(block):
    regions = shm.SharedMemory()
    with pytest.raises(InvalidRequest, match="has 4096"):
        regions.register("r", block.name, 4000, 100)  # 4100 > 4096
    regions.register("r", block.name, 1000, 100)
    block.buf[1000:1004] = b"abcd"
    placed = regions.place({"shared_memory_region": "r", "shared_memory_byte_size": 4}, "input 'x'")
    assert regions.read(placed, "input 'x'") == b"abcd"  # offsets are the window's
    with pytest.raises(InvalidRequest, match="exceeds region 'r' of 100 bytes"):
        regions.place(
            {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": 97},
            "input 'x'",
        )
    with pytest.raises(InvalidRequest, match="shared_memory_byte_size' must be"):
        regions.place({"shared_memory_region": "r"}, "input 'x'")
    out = regions.place({"shared_memory_region": "r", "shared_memory_byte_size": 8}, "output 'y'")
    regions.write(out, b"12345678", "output 'y'")
    assert bytes(block.buf[1000:1008]) == b"12345678"
    with pytest.raises(InvalidRequest, match="9 bytes do not fit"):
        regions.write(out, b"123456789", "output 'y'")
    regions.unregister("r")
    with pytest.raises(InvalidRequest, match="no shared memory region 'r'"):
        regions.write(out, b"1", "output 'y'")  # unregistered between parse and answer
    assert regions.status() == []
