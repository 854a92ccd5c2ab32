"""Input records and output lines: the OpenAI Batch file format, and plain rows.

An input record is one line of a JSONL file or one row of a CSV or Parquet table,
numbered from 1. Every record yields exactly one output line, keyed by `custom_id`
(OpenAI lines carry one; plain rows use `--id-column` or their row number). A line
too broken to have a usable `custom_id` is keyed by its line number, so a resumed
run still knows it was answered.
"""

from __future__ import annotations

import csv
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Record:
    line: int  # 1-based line or row number in the input
    raw: str | dict  # a JSONL line as text (parsed late, so a bad one is a record too) or a row


def input_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown input format; use one of {sorted(FORMATS)}")
    return fmt


def read_records(path: Path) -> Iterator[Record]:
    """Stream the input; Parquet is read a row group at a time."""
    fmt = input_format(path)
    if fmt == "jsonl":
        with path.open("r", encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, 1):
                if text.strip():
                    yield Record(number, text)
    elif fmt == "csv":
        with path.open(newline="", encoding="utf-8") as f:
            for number, row in enumerate(csv.DictReader(f), 1):
                yield Record(number, dict(row))
    else:
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                number += 1
                yield Record(number, row)


def record_key(record: Record, id_column: str | None = None) -> str | None:
    """The custom_id a record will be answered under (None: broken, keyed by line)."""
    if isinstance(record.raw, dict):
        if id_column is None:
            return f"row-{record.line}"
        value = record.raw.get(id_column)
        return None if value in (None, "") else str(value)
    try:
        doc = orjson.loads(record.raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = doc.get("custom_id") if isinstance(doc, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def done_key(custom_id: str | None, line: int) -> str:
    return custom_id if custom_id is not None else f"line:{line}"


def key_of_output(doc: dict) -> str:
    """The done_key of an output line already written (for resuming)."""
    error = doc.get("error") or {}
    return done_key(doc.get("custom_id"), int(error.get("line", 0)))


def ok_line(custom_id: str, body: dict, status: int = 200) -> dict:
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def error_line(
    custom_id: str | None,
    line: int,
    code: str,
    message: str,
    status: int | None = None,
    body: dict | None = None,
) -> dict:
    """A failed record: `error` says why; an API-level failure also carries the HTTP-shaped
    `response` (status and body) the online server would have answered with."""
    doc: dict[str, Any] = {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }
    if status is not None:
        doc["response"] = {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    return doc


def dumps(doc: dict) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
