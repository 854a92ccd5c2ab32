"""Comparison records: numeric, classification and text outputs."""

from __future__ import annotations

import numpy as np
import pytest

from bitserve.rollout.compare import Comparisons, Record, compare_outputs


def test_numeric_outputs_by_max_error_and_cosine():
    a = np.array([[1.0, 0.0, 2.0], [0.0, 3.0, 4.0]], dtype=np.float32)
    b = a + np.array([[0.1, 0.0, 0.0], [0.0, 0.0, -0.4]], dtype=np.float32)
    out = compare_outputs({"e": a}, {"e": b}, {})["e"]
    assert out["max_abs_error"] == pytest.approx(0.4, rel=1e-5)
    assert out["max_rel_error"] == pytest.approx(0.1, rel=1e-5)
    cosines = [
        np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b, strict=True)
    ]
    assert out["cosine"] == pytest.approx(np.mean(cosines))
    assert out["min_cosine"] == pytest.approx(min(cosines))


def test_classification_by_top1_over_the_last_axis():
    a = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    b = np.array([[0.2, 0.8], [0.4, 0.6], [0.1, 0.9], [0.9, 0.1]])
    out = compare_outputs({"p": a}, {"p": b}, {"p": "classification"})["p"]
    assert out == {"top1_agreement": 0.75}
    labels = compare_outputs({"l": np.array([1, 2, 3])}, {"l": np.array([1, 2, 0])}, {})["l"]
    assert labels["top1_agreement"] == pytest.approx(2 / 3)


def test_text_by_exact_match_and_token_agreement():
    a = np.array([b"the cat sat down", b"hello"], dtype=object)
    b = np.array([b"the cat stood down", b"hello"], dtype=object)
    out = compare_outputs({"t": a}, {"t": b}, {})["t"]
    assert out["exact_match"] == 0.5
    assert out["token_agreement"] == pytest.approx((3 / 4 + 1) / 2)


def test_comparisons_keep_totals_over_all_and_a_window_of_records():
    totals = Comparisons(keep=3)
    for i in range(10):
        totals.add(
            Record(1, 2, 10.0, 50.0, True, i % 5 != 0, outputs={"y": {"cosine": 1 - i / 100}})
        )
    summary = totals.summary()
    assert (summary["mirrored"], summary["compared"], summary["shadow_errors"]) == (10, 8, 2)
    cosine = summary["outputs"]["y"]["cosine"]
    assert cosine["count"] == 8 and cosine["min"] == pytest.approx(0.91)
    assert len(totals.recent) == 3


def test_paired_latency_means_over_compared_requests():
    totals = Comparisons()
    totals.add(Record(1, 2, 10.0, 30.0, True, True))
    totals.add(Record(1, 2, 20.0, 50.0, True, True))
    totals.add(Record(1, 2, 99.0, 1.0, True, False))  # a failed shadow: not a pair
    summary = totals.summary()
    assert (summary["primary_ms_mean"], summary["shadow_ms_mean"]) == (15.0, 40.0)


def test_the_summary_shows_the_latest_records_with_both_latencies_and_statuses():
    totals = Comparisons()
    for i in range(15):
        totals.add(Record(1, 2, float(i), 2.0 * i, True, i != 14, shadow_error="boom"))
    recent = totals.summary()["recent"]
    assert len(recent) == 10 and recent[-1]["primary_ms"] == 14.0
    assert recent[-1]["shadow_ms"] == 28.0 and recent[-1]["shadow_ok"] is False
