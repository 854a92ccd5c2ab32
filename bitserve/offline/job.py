"""One `bitserve batch` run: open the journal, load the models, run the file, summarise."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
from tqdm import tqdm

from bitserve.offline.executor import Executor
from bitserve.offline.journal import Journal
from bitserve.offline.pipeline import Pending, Sink, run_file
from bitserve.offline.records import read_records
from bitserve.offline.rows import RowMapping
from bitserve.repository.repository import Repository

log = logging.getLogger("bitserve.batch")


@dataclass
class JobOptions:
    repository: Path
    input: Path
    output: Path
    rows: RowMapping | None = None  # None: the OpenAI Batch format
    max_in_flight: int = 512
    block: int = 4096
    flush_seconds: float = 0.5
    progress: bool = True


@dataclass
class Summary:
    done: int
    failed: int
    skipped: int
    tokens: int
    seconds: float

    def line(self) -> str:
        rate = (self.done + self.failed) / self.seconds if self.seconds else 0.0
        return (
            f"done {self.done}, failed {self.failed}, skipped {self.skipped} (already in the "
            f"output); {rate:.1f} records/s, {self.tokens / max(self.seconds, 1e-9):.0f} tok/s "
            f"in {self.seconds:.2f} s"
        )


def fingerprint(opts: JobOptions) -> str:
    """What must not change between a run and its resumption."""
    stat = opts.input.stat()
    rows = None if opts.rows is None else vars(opts.rows)
    key = [str(opts.input.resolve()), stat.st_size, stat.st_mtime_ns, rows]
    return hashlib.sha256(orjson.dumps(key)).hexdigest()[:16]


def survey(opts: JobOptions) -> tuple[int, list[str]]:
    """Records in the input and the models they name (only those get loaded)."""
    if opts.rows is not None:
        return sum(1 for _ in read_records(opts.input)), [opts.rows.model]
    count, models = 0, set()
    for record in read_records(opts.input):
        count += 1
        with contextlib.suppress(Exception):  # a bad line: the executor answers it
            models.add(orjson.loads(record.raw)["body"]["model"])
    return count, sorted(m for m in models if isinstance(m, str))


async def load_repository(path: Path, models: list[str]) -> Repository:
    repository = Repository(path)
    repository.scan([m for m in models if m in repository.model_names()])
    await repository.load_all()
    return repository


async def open_executor(path: Path, models: list[str], rows: RowMapping | None) -> Executor:
    """The named models loaded (`executor.repository`), ready to run records: what a
    one-process run, each `--workers` process and each Ray actor start with."""
    return Executor(await load_repository(path, models), rows)


def make_bar(opts: JobOptions, total: int, skipped: int) -> tqdm | None:
    if not opts.progress:
        return None
    return tqdm(total=max(total - skipped, 0), unit="rec", desc="batch", dynamic_ncols=True)


async def run_job(opts: JobOptions) -> Summary:
    journal = Journal.open(opts.output, fingerprint(opts))
    total, models = survey(opts)
    executor = await open_executor(opts.repository, models, opts.rows)
    started = time.perf_counter()  # throughput counts the records, not the model load
    sink = Sink(journal, make_bar(opts, total, len(journal.done_keys)))
    id_column = opts.rows.id_column if opts.rows else None
    complete = False
    try:
        records = read_records(opts.input)
        pending = Pending(journal.done_keys, id_column)
        await run_file(
            executor, records, pending, sink, opts.block, opts.max_in_flight, opts.flush_seconds
        )
        complete = True
    finally:
        journal.close(complete)
        if sink.bar is not None:
            sink.bar.close()
        await executor.repository.unload_all()
    seconds = time.perf_counter() - started
    return Summary(sink.done, sink.errors, sink.skipped, sink.total_tokens, seconds)
