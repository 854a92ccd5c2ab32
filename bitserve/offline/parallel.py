"""`--workers N`: one engine per core, each in its own process; answers written here.

An LLM engine steps on one core (its C kernels are single-threaded). `bitserve serve`
needs the other cores for HTTP; a batch job has no HTTP, so it gives every core an
engine (data parallelism, as vLLM's offline API does). This parent keeps the journal
exactly as a one-process run does: it reads the input, skips what the output already
holds (`Pending`) and appends every answer through the `Sink`. N spawned workers each
load the repository once and run records through the same `Executor` and `run_records`.
A worker asks for the next chunk whenever at most `--max-in-flight` of its records are
unanswered, so its engine never drains between chunks and no worker hoards the tail.

Loss-free like one process: only the parent writes, and only answers it has received.
Killed with -9, it takes its workers along (PR_SET_PDEATHSIG, and a closed pipe); the
same command resumes. A worker that dies fails the run at once with a clear error; the
records it held are not in the output, so the rerun does them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from bitserve.offline.job import JobOptions, Summary, fingerprint, make_bar, open_executor, survey
from bitserve.offline.journal import Journal
from bitserve.offline.pipeline import Pending, Sink, run_records
from bitserve.offline.records import Record, dumps, read_records
from bitserve.offline.rows import RowMapping

SHIP_SECONDS = 0.02  # a worker sends its answers at least this often
STOP_SECONDS = 10.0  # a finished worker's time to unload before it is killed


class WorkerError(RuntimeError):
    """A worker failed to load or died; the run stops (rerun it to resume)."""


# ---------------------------------------------------------------- the parent


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Connection
    done: bool = False

    def died(self) -> WorkerError:
        self.process.join(5)
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
        return WorkerError(
            f"batch worker {self.index} (pid {self.process.pid}) {how}; the records it held "
            "are not in the output: run the same command again to do them"
        )

    def receive(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise self.died() from None

    def send(self, chunk: list[Record] | None) -> None:
        try:
            self.conn.send(chunk)
        except OSError:
            raise self.died() from None


def run_parallel(opts: JobOptions, workers: int, threads: int = 1) -> Summary:
    """The job over `workers` processes. Call it on the main thread: a worker's
    PR_SET_PDEATHSIG fires when the thread that started it ends."""
    journal = Journal.open(opts.output, fingerprint(opts))
    total, models = survey(opts)
    size = chunk_size(total - len(journal.done_keys), workers, opts.max_in_flight)
    pool: list[_Worker] = []
    sink: Sink | None = None
    complete = False
    try:
        pool = _start(opts, models, workers, threads)
        _wait_ready(pool)
        started = time.perf_counter()  # from every model loaded, as one process counts
        sink = Sink(journal, make_bar(opts, total, len(journal.done_keys)))
        id_column = opts.rows.id_column if opts.rows else None
        pending = Pending(journal.done_keys, id_column)
        chunks = _chunks(read_records(opts.input), pending, sink, size)
        _drive(pool, chunks, sink, opts.flush_seconds)
        complete = True
    finally:
        journal.close(complete)
        if sink is not None and sink.bar is not None:
            sink.bar.close()
        ended = time.perf_counter()  # the last answer is durable
        _stop(pool)
    assert sink is not None
    return Summary(sink.done, sink.errors, sink.skipped, sink.total_tokens, ended - started)


def chunk_size(remaining: int, workers: int, in_flight: int) -> int:
    """Small enough that every worker takes many (the tail evens out) and that one
    chunk is a fraction of a worker's in-flight records; at most 128."""
    return max(1, min(remaining // (workers * 8), 128, in_flight // 4))


def _chunks(
    records: Iterator[Record], pending: Pending, sink: Sink, size: int
) -> Iterator[list[Record]]:
    while block := list(itertools.islice(records, size)):
        if todo := pending.filter(block, sink):
            yield todo


def _start(opts: JobOptions, models: list[str], workers: int, threads: int) -> list[_Worker]:
    context = multiprocessing.get_context("spawn")
    pool = []
    for index in range(workers):
        conn, child = context.Pipe()
        args = (index, os.getpid(), child, str(opts.repository.resolve()), models, opts.rows)
        process = context.Process(
            target=_worker_main,
            args=(*args, opts.max_in_flight, threads),
            name=f"bitserve-batch-{index}",
        )  # not a daemon: a model with process instances starts children of its own
        process.start()
        child.close()  # the worker holds the only other end: either side sees the other die
        pool.append(_Worker(index, process, conn))
    return pool


def _wait_ready(pool: list[_Worker]) -> None:
    waiting = {w.conn: w for w in pool}
    while waiting:
        for conn in wait(list(waiting)):
            worker = waiting.pop(conn)  # type: ignore[call-overload]
            kind, *detail = worker.receive()
            if kind != "ready":
                raise WorkerError(f"batch worker {worker.index} failed to load:\n{detail[0]}")


def _drive(pool: list[_Worker], chunks: Iterator[list[Record]], sink: Sink, every: float) -> None:
    """Answer each worker's request for work, take its answers, append them every
    `every` seconds (on a thread, so the workers' answers keep being read)."""
    live = {w.conn: w for w in pool}
    appending: Future | None = None

    def flush() -> None:
        nonlocal appending
        if appending is not None:
            appending.result()  # one append at a time, in order; its error is ours
        appending = journal_thread.submit(sink.journal.append, *sink.take())

    with ThreadPoolExecutor(1, thread_name_prefix="bitserve-journal") as journal_thread:
        try:
            due = time.monotonic() + every
            while live:
                for conn in wait(list(live), max(0.0, due - time.monotonic())):
                    worker = live[conn]  # type: ignore[index]
                    kind, *detail = worker.receive()
                    if kind == "answers":
                        for line in detail[0]:
                            sink.add_line(line)
                    elif kind == "more":
                        worker.send(next(chunks, None))  # None: the input is done
                    elif kind == "done":
                        worker.done = True
                        del live[conn]  # type: ignore[arg-type]
                    else:
                        raise WorkerError(f"batch worker {worker.index} failed:\n{detail[0]}")
                if time.monotonic() >= due:
                    flush()
                    due = time.monotonic() + every
        finally:
            flush()  # what arrived is whole and correct: keep it, even on the way out
            assert appending is not None
            appending.result()


def _stop(pool: list[_Worker]) -> None:
    deadline = time.monotonic() + STOP_SECONDS
    for worker in pool:
        if worker.done:  # it unloads and leaves by itself
            worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5)
        worker.conn.close()


# ---------------------------------------------------------------- a worker


def _worker_main(
    index: int,
    parent: int,
    conn: Connection,
    repository: str,
    models: list[str],
    rows: RowMapping | None,
    in_flight: int,
    threads: int,
) -> None:
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import torch

    torch.set_num_threads(threads)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_loop, args=(conn, outbox), daemon=True)
    sender.start()
    code = 0
    try:
        asyncio.run(_serve(conn, outbox.put, repository, models, rows, in_flight))
    except EOFError:  # the parent is gone
        code = 1
    except BaseException:
        code = 1
        outbox.put(("failed", traceback.format_exc()))
    outbox.put(None)
    sender.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # engine threads must not hold the exit


def _die_with(parent: int) -> None:
    """SIGKILL this process when the parent dies (Linux); if it already has, leave."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _send_loop(conn: Connection, outbox: queue.SimpleQueue) -> None:
    """One thread sends, in order, so the event loop never blocks on the pipe."""
    while (message := outbox.get()) is not None:
        try:
            conn.send(message)
        except OSError:
            os._exit(1)  # the parent is gone


async def _serve(
    conn: Connection,
    send,
    repository: str,
    models: list[str],
    rows: RowMapping | None,
    in_flight: int,
) -> None:
    executor = await open_executor(Path(repository), models, rows)
    send(("ready",))
    limit = asyncio.Semaphore(in_flight)
    answers: list[bytes] = []
    held = 0  # records taken and not yet answered
    room = asyncio.Event()
    room.set()

    def on_answer(doc: dict) -> None:
        nonlocal held
        answers.append(dumps(doc))
        held -= 1
        if held <= in_flight:
            room.set()

    def ship() -> None:
        if answers:
            send(("answers", answers[:]))
            answers.clear()

    async def ship_loop() -> None:
        while True:
            await asyncio.sleep(SHIP_SECONDS)
            ship()

    shipper = asyncio.create_task(ship_loop())
    running: set[asyncio.Task] = set()
    while True:
        await room.wait()
        send(("more",))
        chunk = await asyncio.to_thread(conn.recv)
        if chunk is None:
            break
        held += len(chunk)
        if held > in_flight:
            room.clear()
        task = asyncio.create_task(run_records(executor, chunk, on_answer, limit))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    shipper.cancel()
    ship()
    send(("done",))
    with contextlib.suppress(Exception):
        await asyncio.wait_for(executor.repository.unload_all(), STOP_SECONDS / 2)
