"""Comparison records: one mirrored request's primary and shadow answers side by side.

Each output is compared by its kind: numeric (max absolute and relative error, cosine
similarity per row), classification (top-1 agreement: argmax over the last axis, or the
labels themselves for integer outputs) or text (exact match, and token agreement: the
share of whitespace tokens that agree position by position).

Memory is bounded: `Comparisons` keeps exact running totals over every mirrored request
(O(1) per output), and the last `keep` records in a fixed window for inspection.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

EPS = 1e-12
RECENT_SHOWN = 10  # of the window of records, the latest shown in a report


@dataclass
class Record:
    """One mirrored request."""

    primary: int  # version numbers
    shadow: int
    primary_ms: float
    shadow_ms: float
    primary_ok: bool
    shadow_ok: bool
    shadow_error: str | None = None
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def kind_of(array: np.ndarray, declared: str | None) -> str:
    if declared is not None:
        return declared
    if array.dtype == object or array.dtype.kind in "SU":
        return "text"
    if array.dtype.kind in "iub":
        return "classification"
    return "numeric"


def compare_outputs(
    primary: dict[str, Any], shadow: dict[str, Any], kinds: dict[str, str]
) -> dict[str, dict[str, float]]:
    """Per output present in both: the figures for its kind."""
    out = {}
    for name, a in primary.items():
        if name not in shadow:
            continue
        a, b = np.asarray(a), np.asarray(shadow[name])
        kind = kind_of(a, kinds.get(name))
        if kind == "text":
            out[name] = text_agreement(a, b)
        elif kind == "classification":
            out[name] = top1_agreement(a, b)
        else:
            out[name] = numeric_difference(a, b)
    return out


def numeric_difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    if a.shape != b.shape:
        return {"shape_mismatch": 1.0}
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    rows_a = a64.reshape(a64.shape[0], -1) if a64.ndim > 1 else a64.reshape(1, -1)
    rows_b = b64.reshape(rows_a.shape)
    norms = np.linalg.norm(rows_a, axis=1) * np.linalg.norm(rows_b, axis=1)
    dots = np.sum(rows_a * rows_b, axis=1)
    # two zero vectors are the same vector: cosine 1
    cosine = np.where(norms > EPS, dots / np.maximum(norms, EPS), 1.0)
    return {
        "max_abs_error": float(diff.max(initial=0.0)),
        "max_rel_error": float((diff / np.maximum(np.abs(a64), EPS)).max(initial=0.0)),
        "cosine": float(cosine.mean()),
        "min_cosine": float(cosine.min(initial=1.0)),
    }


def top1_agreement(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    if a.shape != b.shape:
        return {"shape_mismatch": 1.0}
    if a.dtype.kind in "iub" or a.ndim == 0 or a.shape[-1] == 1:
        labels_a, labels_b = a.reshape(-1), b.reshape(-1)  # labels already
    else:
        labels_a, labels_b = a.argmax(axis=-1).reshape(-1), b.argmax(axis=-1).reshape(-1)
    return {"top1_agreement": float(np.mean(labels_a == labels_b)) if labels_a.size else 1.0}


def text_agreement(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    texts_a = [_text(x) for x in a.reshape(-1)]
    texts_b = [_text(x) for x in b.reshape(-1)]
    if len(texts_a) != len(texts_b):
        return {"shape_mismatch": 1.0}
    exact = [x == y for x, y in zip(texts_a, texts_b, strict=True)]
    tokens = [_token_agreement(x, y) for x, y in zip(texts_a, texts_b, strict=True)]
    return {
        "exact_match": float(np.mean(exact)) if exact else 1.0,
        "token_agreement": float(np.mean(tokens)) if tokens else 1.0,
    }


def _text(item: Any) -> str:
    return item.decode(errors="replace") if isinstance(item, bytes) else str(item)


def _token_agreement(a: str, b: str) -> float:
    ta, tb = a.split(), b.split()
    longest = max(len(ta), len(tb))
    if longest == 0:
        return 1.0
    return sum(x == y for x, y in zip(ta, tb, strict=False)) / longest


class Comparisons:
    """Running totals over every mirrored request, and a window of recent records."""

    def __init__(self, keep: int = 100):
        self.recent: deque[Record] = deque(maxlen=keep)
        self.mirrored = 0
        self.both_ok = 0
        self.shadow_errors = 0
        self.primary_errors = 0
        self.latency_ms = [0.0, 0.0]  # primary, shadow: sums over the compared pairs
        # output -> figure -> [count, sum, min, max]
        self.totals: dict[str, dict[str, list[float]]] = {}

    def add(self, record: Record) -> None:
        self.recent.append(record)
        self.mirrored += 1
        self.shadow_errors += not record.shadow_ok
        self.primary_errors += not record.primary_ok
        if not (record.primary_ok and record.shadow_ok):
            return
        self.both_ok += 1
        self.latency_ms[0] += record.primary_ms
        self.latency_ms[1] += record.shadow_ms
        for name, figures in record.outputs.items():
            totals = self.totals.setdefault(name, {})
            for figure, value in figures.items():
                t = totals.setdefault(figure, [0, 0.0, value, value])
                t[0] += 1
                t[1] += value
                t[2] = min(t[2], value)
                t[3] = max(t[3], value)

    def summary(self) -> dict:
        outputs = {
            name: {
                figure: {"mean": t[1] / t[0], "min": t[2], "max": t[3], "count": int(t[0])}
                for figure, t in figures.items()
            }
            for name, figures in self.totals.items()
        }
        pairs = max(self.both_ok, 1)
        return {
            "mirrored": self.mirrored,
            "compared": self.both_ok,
            # the same requests on both: the paired latency comparison
            "primary_ms_mean": self.latency_ms[0] / pairs,
            "shadow_ms_mean": self.latency_ms[1] / pairs,
            "shadow_errors": self.shadow_errors,
            "primary_errors": self.primary_errors,
            "outputs": outputs,
            "recent": [asdict(r) for r in list(self.recent)[-RECENT_SHOWN:]],
        }
