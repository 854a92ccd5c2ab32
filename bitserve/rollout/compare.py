"""Comparison records: one mirrored request's primary and shadow answers side by side.

Each output is compared by its kind: numeric (max absolute and relative error, cosine
similarity per row), classification (top-1 agreement: argmax over the last axis, or the
labels themselves for integer outputs) or text (exact match, and token agreement: the
share of whitespace tokens that agree position by position).

Detections (an output `boxes` of [..., K, 4], or one declared "boxes") are compared as
a set, not slot by slot: a shadow box agrees with a primary box of the same class when
their IoU is at least 0.5 (matched greedily, best score first), and `box_agreement` is
2 * matched / (primary boxes + shadow boxes) per row (1 when both found nothing), with
`mean_iou` over the matched pairs. The companion outputs (`scores`, `classes`,
`num_detections`) only say which slots hold detections, so they are not compared slot
by slot: an int8 variant that ranks two equal boxes the other way still agrees.

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
    boxes = _box_output(primary, shadow, kinds)
    skip = {boxes, *DETECTION_PARTS[1:]} if boxes else set()  # the box output as it is named
    if boxes:
        out[boxes] = box_agreement(_detections(primary, boxes), _detections(shadow, boxes))
    for name, a in primary.items():
        if name not in shadow or name in skip:
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


DETECTION_PARTS = ("boxes", "scores", "classes", "num_detections")
MATCH_IOU = 0.5


def _box_output(primary: dict, shadow: dict, kinds: dict[str, str]) -> str | None:
    """The name of the detections' box output, if these outputs are detections."""
    for name, a in primary.items():
        declared = kinds.get(name)
        a = np.asarray(a)
        looks_like = name == "boxes" and a.ndim >= 2 and a.shape[-1] == 4 and a.dtype.kind == "f"
        if name in shadow and (declared == "boxes" or (declared is None and looks_like)):
            return name
    return None


def _detections(outputs: dict, boxes_name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: the valid boxes [n, 4] and their classes [n]."""
    boxes = np.asarray(outputs[boxes_name], dtype=np.float64)
    boxes = boxes.reshape(-1, boxes.shape[-2], 4) if boxes.ndim > 2 else boxes[None]
    rows, slots = boxes.shape[:2]
    classes = outputs.get("classes")
    classes = np.zeros((rows, slots)) if classes is None else np.asarray(classes)
    classes = classes.reshape(rows, slots)
    if "num_detections" in outputs:
        counts = np.asarray(outputs["num_detections"]).reshape(rows, -1)[:, 0]
        valid = np.arange(slots)[None, :] < counts[:, None]
    elif "scores" in outputs:
        valid = np.asarray(outputs["scores"]).reshape(rows, slots) > 0
    else:
        valid = np.ones((rows, slots), bool)
    return [(boxes[r][valid[r]], classes[r][valid[r]]) for r in range(rows)]


def box_agreement(primary: list, shadow: list) -> dict[str, float]:
    """IoU-matched agreement of two detectors' answers to the same rows."""
    if len(primary) != len(shadow):
        return {"shape_mismatch": 1.0}
    agreements, ious = [], []
    for (boxes_a, classes_a), (boxes_b, classes_b) in zip(primary, shadow, strict=True):
        matched = _match(boxes_a, classes_a, boxes_b, classes_b)
        ious += matched
        total = len(boxes_a) + len(boxes_b)
        agreements.append(2 * len(matched) / total if total else 1.0)
    return {
        "box_agreement": float(np.mean(agreements)) if agreements else 1.0,
        "mean_iou": float(np.mean(ious)) if ious else 1.0,
    }


def _match(boxes_a, classes_a, boxes_b, classes_b) -> list[float]:
    """Greedy matching in `a`'s order (best score first): the IoU of each matched pair."""
    if len(boxes_a) == 0 or len(boxes_b) == 0:
        return []
    iou = _iou_matrix(boxes_a, boxes_b)
    iou[classes_a[:, None] != classes_b[None, :]] = 0.0
    taken, matched = np.zeros(len(boxes_b), bool), []
    for row in iou:
        candidates = np.where(taken, -1.0, row)
        best = int(candidates.argmax())
        if candidates[best] >= MATCH_IOU:
            taken[best] = True
            matched.append(float(candidates[best]))
    return matched


def _iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` with every box of `b` (x1, y1, x2, y2)."""
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(bottom_right - top_left, 0, None).prod(axis=2)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(axis=1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > EPS, inter / np.maximum(union, EPS), 0.0)


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
