"""`--ray`: the file spread over a Ray cluster with Ray Data, answers written here.

The driver keeps the journal: it skips what the output already holds, ships the rest
as a Ray dataset, and appends each batch of answers that comes back, so a Ray run is
exactly as resumable as a local one and writes the same lines. Each worker is an
actor that loads the repository once and runs records through the same `Executor`
and pipeline as `bitserve batch` without Ray.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import orjson

from bitserve.offline.job import (
    JobOptions,
    Summary,
    fingerprint,
    make_bar,
    open_executor,
    survey,
)
from bitserve.offline.journal import Journal
from bitserve.offline.pipeline import Pending, Sink, run_records
from bitserve.offline.records import Record, dumps, read_records
from bitserve.offline.rows import RowMapping


class Worker:
    """A Ray Data actor: its own event loop on a thread, the repository loaded on it."""

    def __init__(self, repository: str, models: list[str], rows: dict | None, in_flight: int):
        from pathlib import Path

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        mapping = RowMapping(**rows) if rows else None
        self.executor = self._call(open_executor(Path(repository), models, mapping))
        self.in_flight = in_flight

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        records = [
            Record(int(line), orjson.loads(raw) if is_row else str(raw))
            for line, raw, is_row in zip(batch["line"], batch["raw"], batch["row"], strict=True)
        ]
        answers: list[bytes] = []

        async def run() -> None:
            limit = asyncio.Semaphore(self.in_flight)
            await run_records(self.executor, records, lambda d: answers.append(dumps(d)), limit)

        self._call(run())
        return {"answer": np.array(answers, dtype=object)}


def _item(record: Record) -> dict:
    is_row = isinstance(record.raw, dict)
    raw = orjson.dumps(record.raw, default=str).decode() if is_row else record.raw
    return {"line": record.line, "raw": raw, "row": is_row}


def run_ray(opts: JobOptions, address: str, workers: int, batch_size: int = 256) -> Summary:
    import ray

    started = time.perf_counter()
    journal = Journal.open(opts.output, fingerprint(opts))
    total, models = survey(opts)
    if not ray.is_initialized() and address == "local":
        ray.init(num_cpus=workers + 1, log_to_driver=False)  # a worker each, one for Ray Data
    elif not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    sink = Sink(journal, make_bar(opts, total, len(journal.done_keys)))
    id_column = opts.rows.id_column if opts.rows else None
    todo = Pending(journal.done_keys, id_column).filter(read_records(opts.input), sink)
    complete = False
    try:
        if todo:
            blocks = max(workers, -(-len(todo) // batch_size))  # every worker gets work
            size = -(-len(todo) // blocks)
            items = [_item(r) for r in todo]
            dataset = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
                Worker,
                fn_constructor_kwargs={
                    "repository": str(opts.repository.resolve()),
                    "models": models,
                    "rows": vars(opts.rows) if opts.rows else None,
                    "in_flight": opts.max_in_flight,
                },
                batch_size=size,
                concurrency=workers,
                num_cpus=1,
            )
            for batch in dataset.iter_batches(batch_size=None):
                for answer in batch["answer"]:
                    sink.add_line(bytes(answer))
                sink.flush()
        sink.flush()
        complete = True
    finally:
        journal.close(complete)
        if sink.bar is not None:
            sink.bar.close()
    seconds = time.perf_counter() - started
    return Summary(sink.done, sink.errors, sink.skipped, sink.total_tokens, seconds)
