"""The LLM engine in a local child process: `isolation = "process"` on an llm model.

The engine thread of an in-process `LLMService` shares the server's interpreter (its
GIL) with the event loop: the engine's Python and the front door's take turns. Here
the engine runs in a child process (on 2 cores, tinylm's 96 saturating streams got
1.96x the tokens/s; refusals under that load were not faster, since the loop still
takes each step's outputs for every stream: bench/overload.py --isolation). It runs
on this machine, as a Ray replica does on its node (`llmreplicas.LLMReplicaActor`,
detokenising its own outputs), and the server keeps the same front door as
`RayLLMService` (tokenizer, chat template, checks, one admission queue, the router for
`count` > 1): `ProcessLLMService` is `RayLLMService` over `LocalHandle`, a pipe to the
child instead of a Ray actor. No Ray is imported or started.

One message goes to the child per request (`submit`) and per abort; one comes back per
engine step with every request's new tokens and text (`outputs`). A reader thread per
pipe hands what arrives to the event loop. The child exits when the server does: it
asks the kernel for SIGKILL on its parent's death (PR_SET_PDEATHSIG) and exits on the
pipe's end-of-file. A child that dies (killed, crashed) is a lost replica: its streams
end with EngineDead (503, Retry-After) and a replacement starts.

    backend = "llm"
    [instance_group]
    isolation = "process"
    count = 1        # N engine processes on this machine, routed by prefix (PrefixRouter)
    threads = 0      # torch threads of each engine process; 0: the server's (serve --threads)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from bitserve.config import ModelConfig
from bitserve.repository.llmreplicas import (
    LLMReplicaActor,
    RayLLMService,
    ReplicaLost,
    _portable,
)

log = logging.getLogger("bitserve.repository")

END = object()  # the child's output stream ended
PR_SET_PDEATHSIG = 1


class LocalHandle:
    """The transport to one engine process, with `RayHandle`'s methods: calls go down a
    multiprocessing pipe as (id, method, args); replies and output batches come back
    and a reader thread hands them to the event loop."""

    def __init__(self, config: ModelConfig, version_dir: Path, slot: int):
        self.loop = asyncio.get_running_loop()
        threads = config.instance_group.threads
        if not threads and "torch" in sys.modules:  # the server's (`serve --threads`)
            threads = sys.modules["torch"].get_num_threads()
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_child_main,
            args=(
                config.model_dump(mode="json"),
                str(version_dir),
                threads,
                child,
                os.getpid(),
            ),
            name=f"bitserve-llm-{config.name}-{slot}",
            daemon=True,
        )
        self.process.start()  # on the loop's thread: PDEATHSIG follows the forking thread
        child.close()
        self.pending: dict[int, asyncio.Future] = {}
        self.batches: asyncio.Queue = asyncio.Queue()
        self.lost: str | None = None
        self._calls = itertools.count()
        self.reader = threading.Thread(
            target=self._read, name=f"bitserve-llm-{config.name}-{slot}-reader", daemon=True
        )
        self.reader.start()

    # ---------------------------------------------------------------- the pipe

    def _read(self) -> None:
        """The reader thread: every message to the loop, then the child's end."""
        try:
            while True:
                message = self.conn.recv()
                self.loop.call_soon_threadsafe(self._deliver, message)
        except (EOFError, OSError):
            pass
        except Exception as e:  # an output that would not unpickle: the stream is broken
            log.error("LLM engine process %d: unreadable message: %r", self.process.pid, e)
        self.process.join(1)
        code = self.process.exitcode
        why = f"engine process {self.process.pid} exited" + (
            f" (exit code {code})" if code is not None else ""
        )
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._gone, why)

    def _deliver(self, message: tuple) -> None:
        if message[0] == "out":
            self.batches.put_nowait(message[1])
            return
        _, call, ok, result = message
        future = self.pending.pop(call, None)
        if future is not None and not future.done():
            if ok:
                future.set_result(result)
            else:
                future.set_exception(result)

    def _gone(self, why: str) -> None:
        self.lost = why
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ReplicaLost(why))
        self.pending.clear()
        self.batches.put_nowait(END)

    def _send(self, message: tuple) -> None:
        if self.lost is not None:
            raise ReplicaLost(self.lost)
        try:
            self.conn.send(message)
        except (OSError, ValueError) as e:  # the child is gone (or the pipe closed)
            raise ReplicaLost(f"engine process {self.process.pid}: {e}") from None

    async def _call(self, method: str, *args: Any) -> Any:
        call = next(self._calls)
        future = self.loop.create_future()
        self.pending[call] = future
        try:
            self._send((call, method, args))
        except ReplicaLost:
            self.pending.pop(call, None)
            raise
        return await future

    # ---------------------------------------------------------------- RayHandle's methods

    async def start(self) -> dict:
        return await self._call("start")

    async def submit(self, *args: Any) -> None:
        await self._call("submit", *args)

    async def outputs(self):
        while True:
            batch = await self.batches.get()
            if batch is END:
                raise ReplicaLost(self.lost or "its output stream ended")
            yield batch

    def abort(self, key: int) -> None:
        self._send((None, "abort", (key,)))  # no reply

    async def health(self) -> tuple[str | None, dict]:
        return await self._call("health")

    async def stop(self) -> None:
        with contextlib.suppress(ReplicaLost):
            await self._call("stop")
        await asyncio.to_thread(self.process.join, 10)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        with contextlib.suppress(OSError):
            self.conn.close()

    def describe(self) -> str:
        return f"engine process {self.process.pid}"


class ProcessLLMService(RayLLMService):
    """`RayLLMService` whose replicas are engine processes on this machine."""

    def _connect(self) -> None:
        pass  # no cluster

    def _handle(self, slot: int) -> LocalHandle:
        return LocalHandle(self.config, self.version_dir, slot)


# ---------------------------------------------------------------- the child


def _child_main(config_doc: dict, version_dir: str, threads: int, conn: Any, parent: int):
    """The engine process: an `LLMReplicaActor` answering the pipe's calls."""
    with contextlib.suppress(Exception):  # Linux: die with the server, even on its SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the prctl
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the server's to handle
    multiprocessing.current_process().daemon = False  # its engine may start TP workers
    asyncio.run(_serve(config_doc, version_dir, threads, conn))
    os._exit(0)  # the engine's threads are done with; do not wait on anything else


async def _serve(config_doc: dict, version_dir: str, threads: int, conn: Any) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    actor: LLMReplicaActor | None = None
    tasks: set[asyncio.Task] = set()

    def send(message: tuple) -> None:
        try:
            conn.send(message)
        except (OSError, ValueError):  # the server is gone
            os._exit(0)

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the server closed the pipe or died
            loop.call_soon_threadsafe(dispatch, message)

    def dispatch(message: tuple) -> None:
        task = asyncio.create_task(run(*message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def forward() -> None:
        assert actor is not None
        async for batch in actor.outputs():
            send(("out", batch))

    async def run(call: int | None, method: str, args: tuple) -> None:
        nonlocal actor
        try:
            if method == "start":
                actor = LLMReplicaActor(config_doc, version_dir, threads)
                result = await actor.start()
                dispatch_forward = asyncio.create_task(forward())
                tasks.add(dispatch_forward)
            else:
                assert actor is not None, f"{method} before start"
                result = await getattr(actor, method)(*args)
            ok = True
        except Exception as e:
            result, ok = _portable(e), False
        if call is not None:
            send(("reply", call, ok, result))
        if method == "stop" or (method == "start" and not ok):
            done.set()

    threading.Thread(target=read, name="bitserve-llm-pipe", daemon=True).start()
    await done.wait()
