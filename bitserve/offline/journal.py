"""The output file as a journal: durable chunks plus a progress record, for resuming.

Each chunk of output lines is appended, flushed and fsync'd; only then is the progress
record (`OUTPUT.progress`: the committed byte offset and counts) replaced atomically
(write, fsync, rename). A run killed at any instant leaves an output whose first
`offset` bytes are whole, durable lines. Resuming truncates the output to that offset
(dropping a torn or unrecorded tail, which is simply recomputed) and reads back the
keys already answered, so every record appears exactly once.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from bitserve.offline.records import key_of_output


class JournalError(RuntimeError):
    """The output cannot be resumed safely (different arguments, a foreign file)."""


@dataclass
class Progress:
    fingerprint: str
    offset: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    complete: bool = False
    extra: dict = field(default_factory=dict)


class Journal:
    def __init__(self, path: Path, progress: Progress, done_keys: set[str]):
        self.path = path
        self.progress_path = progress_path(path)
        self.progress = progress
        self.done_keys = done_keys
        self._file = path.open("ab")

    @classmethod
    def open(cls, path: Path, fingerprint: str) -> Journal:
        """Start a new output, or resume one written with the same fingerprint."""
        record = progress_path(path)
        if record.exists():
            progress = Progress(**orjson.loads(record.read_bytes()))
            if progress.fingerprint != fingerprint:
                raise JournalError(
                    f"{path} was written by a run with other arguments or input; "
                    "use another --output or delete it and its .progress file"
                )
            return cls(path, progress, _committed_keys(path, progress.offset))
        if path.exists() and path.stat().st_size > 0:
            raise JournalError(f"{path} exists and has no progress record; refusing to append")
        progress = Progress(fingerprint)
        _write_atomic(record, progress)  # before any output byte: a rerun can always resume
        return cls(path, progress, set())

    def append(self, lines: list[bytes], failed: int, tokens: int) -> None:
        """Make `lines` durable, then record them as done."""
        if not lines:
            return
        data = b"".join(lines)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        p = self.progress
        p.offset += len(data)
        p.done += len(lines) - failed
        p.failed += failed
        p.tokens += tokens
        _write_atomic(self.progress_path, p)

    def close(self, complete: bool) -> None:
        self.progress.complete = complete
        _write_atomic(self.progress_path, self.progress)
        self._file.close()


def progress_path(path: Path) -> Path:
    return path.with_name(path.name + ".progress")


def _committed_keys(path: Path, offset: int) -> set[str]:
    """Cut the output back to its committed length and read the keys it holds."""
    if not path.exists():
        if offset:
            raise JournalError(f"{path} is missing but its progress record says {offset} bytes")
        return set()
    if path.stat().st_size < offset:
        raise JournalError(f"{path} is shorter than its progress record ({offset} bytes)")
    with path.open("r+b") as f:
        f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())
    keys = set()
    with path.open("rb") as f:
        for line in f:
            keys.add(key_of_output(orjson.loads(line)))
    return keys


def _write_atomic(path: Path, progress: Progress) -> None:
    temp = path.with_name(path.name + ".tmp")
    with temp.open("wb") as f:
        f.write(orjson.dumps(asdict(progress)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
