"""Records through the executor at full throughput, answers into the journal.

Reading, computing and writing overlap: blocks of records are read on a thread while
earlier ones run, answers are made durable on a thread while later ones run. Within a
block, records run shortest first (length bucketing), so a dynamic batch or an engine
step holds inputs of similar length; up to `max_in_flight` run at once, which keeps the
LLM engine's continuous batch full across the whole file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator

import orjson

from bitserve.offline.executor import Executor
from bitserve.offline.journal import Journal
from bitserve.offline.records import Record, done_key, dumps, error_line, record_key


class Sink:
    """Answers waiting to be written; counts what the summary and progress bar show."""

    def __init__(self, journal: Journal, bar=None):
        self.journal, self.bar = journal, bar
        self.lines: list[bytes] = []
        self.failed = self.tokens = 0
        self.done = self.errors = self.skipped = self.total_tokens = 0
        self.started = time.perf_counter()

    def add(self, doc: dict) -> None:
        self.add_line(dumps(doc), doc)

    def add_line(self, line: bytes, doc: dict | None = None) -> None:
        """An answer already serialized (by a worker process or a Ray actor)."""
        doc = orjson.loads(line) if doc is None else doc
        self.lines.append(line)
        body = (doc.get("response") or {}).get("body") or {}
        tokens = (body.get("usage") or {}).get("total_tokens", 0) if isinstance(body, dict) else 0
        failed = doc.get("error") is not None
        self.failed += failed
        self.errors += failed
        self.done += not failed
        self.tokens += tokens
        self.total_tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{self.total_tokens / elapsed:.0f} tok/s", refresh=False)

    def take(self) -> tuple[list[bytes], int, int]:
        taken = self.lines, self.failed, self.tokens
        self.lines, self.failed, self.tokens = [], 0, 0
        return taken

    def flush(self) -> None:
        self.journal.append(*self.take())


class Pending:
    """Decides, record by record, what still needs an answer: skips keys the journal
    holds, answers a repeated custom_id with an error keyed by its line number."""

    def __init__(self, done_keys: set[str], id_column: str | None):
        self.done_keys, self.id_column = done_keys, id_column
        self.seen: set[str] = set()

    def filter(self, records: Iterable[Record], sink: Sink) -> list[Record]:
        out = []
        for record in records:
            key = record_key(record, self.id_column)
            duplicate = key is not None and key in self.seen
            if key is not None:
                self.seen.add(key)
            if done_key(None if duplicate else key, record.line) in self.done_keys:
                sink.skipped += 1
            elif duplicate:
                sink.add(error_line(None, record.line, "duplicate_custom_id", f"{key!r} again"))
            else:
                out.append(record)
        return out


async def run_records(
    executor: Executor, records: list[Record], on_answer, limit: asyncio.Semaphore
) -> None:
    """Prepare, bucket by length, run with at most `limit` in flight (shared by blocks)."""
    works = []
    for record in records:
        work = executor.prepare(record)
        if isinstance(work, dict):
            on_answer(work)
        else:
            works.append(work)
    works.sort(key=lambda w: w.length)

    async def answer(work) -> None:
        try:  # in the task, not a done callback: an error here must fail the run
            on_answer(await executor.run(work))
        finally:
            limit.release()

    tasks: set[asyncio.Task] = set()
    for work in works:
        await limit.acquire()
        task = asyncio.create_task(answer(work))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*list(tasks))


async def run_file(
    executor: Executor,
    records: Iterator[Record],
    pending: Pending,
    sink: Sink,
    block: int = 4096,
    max_in_flight: int = 512,
    flush_seconds: float = 0.5,
) -> None:
    stop = asyncio.Event()
    flusher = asyncio.create_task(_flush_loop(sink, stop, flush_seconds))
    limit = asyncio.Semaphore(max_in_flight)
    running: deque[asyncio.Task] = deque()
    try:
        while chunk := await asyncio.to_thread(lambda: list(itertools.islice(records, block))):
            todo = pending.filter(chunk, sink)
            running.append(asyncio.create_task(run_records(executor, todo, sink.add, limit)))
            if len(running) > 2:  # read ahead of compute, but hold at most 3 blocks
                await running.popleft()
        await asyncio.gather(*running)
    finally:
        stop.set()
        await flusher


async def _flush_loop(sink: Sink, stop: asyncio.Event, seconds: float) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        taken = sink.take()
        await asyncio.to_thread(sink.journal.append, *taken)
