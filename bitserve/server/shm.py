"""Triton's system shared-memory extension: tensors that travel through a POSIX
shared-memory object instead of the request body.

A client creates an object (`tritonclient.utils.shared_memory.create_shared_memory_region`),
registers a window of it under a name (`/v2/systemsharedmemory/region/{name}/register`,
or the SystemSharedMemoryRegister RPC), then names the region in an input's or an
output's parameters: `shared_memory_region`, `shared_memory_byte_size` and the optional
`shared_memory_offset`, relative to the registered window. An input is read from the
region (one copy, when the request is parsed); an output is written into it when the
response is encoded, and the response carries only its name, shape and the byte size
written.

Invariants:
- every access is bounds-checked against the registered window, and the window against
  the object's size at registration: a window, offset or size that does not fit is an
  `InvalidRequest` (400) naming the tensor and the region;
- no buffer of a mapping outlives the call that made it (reads are copies, writes are
  slice assignments), so unregistering never waits and never fails on a live view;
- the server only opens objects that exist (it never creates one) by a plain name in
  /dev/shm, so a key cannot reach any other file.

Admin rules (who may register): reading a region feeds another process's memory to a
model and writing one changes it, so register, unregister and status are admin calls.
With `--admin-token` they need `Authorization: Bearer <token>` (HTTP header or gRPC
metadata), from any peer; without one they are accepted from a loopback peer only,
the only place shared memory can be shared from. Any client may then infer with a
registered region. The object's own permissions still apply: the server opens it with
its own user's rights (tritonclient creates objects with mode 0600).

CUDA shared memory (`/v2/cudasharedmemory/...`, the CudaSharedMemory* RPCs): status
lists no region and unregister has nothing to remove; register is refused with a 400
that says why (no GPU here, or, on a GPU instance, that bitserve does not map CUDA IPC
handles yet).
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.inference import InvalidRequest
from bitserve.server.errors import Forbidden, handle
from bitserve.server.http import json_response

# state.py's ServerState, which holds the one SharedMemory (a name here, not an import:
# state.py imports this module)
ServerState = Any

SHM_DIR = "/dev/shm"
KEY = re.compile(r"/?[^/\x00]+")
LOOPBACK = {"127.0.0.1", "::1", "localhost", "testclient", ""}  # "": a unix socket


@dataclass
class Region:
    name: str
    key: str
    offset: int  # the window's start in the object
    byte_size: int  # the window's size
    memory: mmap.mmap  # the whole object

    def status(self) -> dict:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies: `byte_size` bytes from `offset` in the region's window."""

    region: str
    offset: int
    byte_size: int


class SharedMemory:
    """The registered regions of one server process, by name."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidRequest("field 'name': a region needs a name")
        if name in self.regions:
            raise InvalidRequest(f"shared memory region '{name}' is already registered")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"field '{field}' must be a non-negative integer")
        memory = _open(key, offset + byte_size)
        self.regions[name] = Region(name, key, offset, byte_size, memory)

    def unregister(self, name: str | None = None) -> None:
        """Unregister `name` (none registered: nothing to do, as Triton), or all."""
        names = list(self.regions) if not name else [name]
        for n in names:
            region = self.regions.pop(n, None)
            if region is not None:
                region.memory.close()

    def status(self, name: str | None = None) -> list[dict]:
        if not name:
            return [r.status() for r in self.regions.values()]
        return [self._region(name, "status").status()]

    def close(self) -> None:
        self.unregister()

    # ------------------------------------------------------------ tensors

    def place(self, params: dict, where: str) -> Placement | None:
        """The placement a tensor's parameters ask for, checked against its region
        (None: the tensor is not in shared memory)."""
        name = params.get("shared_memory_region")
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}: shared_memory_region must be a string")
        size = _count(params, "shared_memory_byte_size", where, required=True)
        offset = _count(params, "shared_memory_offset", where)
        region = self._region(name, where)
        if offset + size > region.byte_size:
            raise InvalidRequest(
                f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {size} "
                f"exceeds region '{name}' of {region.byte_size} bytes"
            )
        return Placement(name, offset, size)

    def read(self, placement: Placement, where: str) -> bytes:
        region = self._region(placement.region, where)
        start = region.offset + placement.offset
        return region.memory[start : start + placement.byte_size]

    def write(self, placement: Placement, data: bytes, where: str) -> None:
        if len(data) > placement.byte_size:
            raise InvalidRequest(
                f"{where}: {len(data)} bytes do not fit shared_memory_byte_size "
                f"{placement.byte_size} in region '{placement.region}'"
            )
        region = self._region(placement.region, where)  # it may have gone since parsing
        start = region.offset + placement.offset
        region.memory[start : start + len(data)] = data

    def _region(self, name: str, where: str) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise InvalidRequest(f"{where}: no shared memory region '{name}' is registered")
        return region


def authorize(state: ServerState, peer: str | None, authorization: str) -> None:
    """The admin rules of the module's docstring: the admin token when the server has
    one, else a loopback peer."""
    if state.options.admin_token:
        state.authorize(authorization)
    elif (peer or "") not in LOOPBACK:
        raise Forbidden(
            "shared memory is managed from the server's own host only (or start the server "
            "with --admin-token and send it)"
        )


def refuse_cuda() -> InvalidRequest:
    """The clear refusal of a CUDA region."""
    import torch

    if not torch.cuda.is_available():
        return InvalidRequest(
            "CUDA shared memory needs a GPU instance: this server has no CUDA device "
            "(use system shared memory)"
        )
    return InvalidRequest(
        "CUDA shared memory is not supported by bitserve yet: use system shared memory"
    )


def _open(key: str, needed: int) -> mmap.mmap:
    if not isinstance(key, str) or not KEY.fullmatch(key) or key.strip("/") in (".", ".."):
        raise InvalidRequest(f"field 'key': {key!r} is not a shared memory object's name")
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise InvalidRequest(
            f"field 'key': cannot open shared memory {key!r}: {e.strerror}"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if needed > size:
            raise InvalidRequest(
                f"field 'byte_size': offset + byte_size is {needed} bytes but shared memory "
                f"{key!r} has {size}"
            )
        if size == 0:
            raise InvalidRequest(f"field 'key': shared memory {key!r} is empty")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _count(params: dict, key: str, where: str, required: bool = False) -> int:
    value = params.get(key)
    if value is None and not required:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{where}: parameter '{key}' must be a non-negative integer")
    return value


# ------------------------------------------------------------------ HTTP routes


def routes(state: ServerState) -> list[Route]:
    system, cuda = "/v2/systemsharedmemory", "/v2/cudasharedmemory"
    region = "/region/{name}"
    guard = _guard(state)
    found = []
    for base, calls in ((system, _System(state)), (cuda, _Cuda())):
        found += [
            Route(base + "/status", guard(calls.status), methods=["GET"]),
            Route(base + region + "/status", guard(calls.status), methods=["GET"]),
            Route(base + region + "/register", guard(calls.register), methods=["POST"]),
            Route(base + "/unregister", guard(calls.unregister), methods=["POST"]),
            Route(base + region + "/unregister", guard(calls.unregister), methods=["POST"]),
        ]
    return found


def _guard(state: ServerState) -> Callable:
    def guard(call: Callable) -> Callable:
        async def guarded(request: Request) -> Response:
            peer = request.client.host if request.client else None
            authorize(state, peer, request.headers.get("authorization", ""))
            return json_response(await call(request.path_params.get("name"), request))

        return handle(guarded)

    return guard


async def _body(request: Request) -> dict:
    from bitserve.api.jsonbody import json_object

    return json_object(await request.body())


class _System:
    def __init__(self, state: ServerState):
        self.shm = state.shm

    async def status(self, name: str | None, request: Request) -> Any:
        return self.shm.status(name)

    async def register(self, name: str, request: Request) -> Any:
        body = await _body(request)
        self.shm.register(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        return {}

    async def unregister(self, name: str | None, request: Request) -> Any:
        self.shm.unregister(name)
        return {}


class _Cuda:
    async def status(self, name: str | None, request: Request) -> Any:
        if name:
            raise InvalidRequest(f"no CUDA shared memory region '{name}' is registered")
        return []

    async def register(self, name: str, request: Request) -> Any:
        raise refuse_cuda()

    async def unregister(self, name: str | None, request: Request) -> Any:
        return {}
