"""The report's recommendation: promote, keep watching (with how many more), roll back."""

from __future__ import annotations

import random

import numpy as np
from scipy import stats as sp

from bitserve.config import Traffic
from bitserve.metrics import Metrics
from bitserve.rollout import verdict
from bitserve.rollout.compare import Record
from bitserve.rollout.state import ModelRollout


def _rollout(traffic: Traffic) -> ModelRollout:
    return ModelRollout("m", traffic, Metrics(), random.Random(0))


def _feed(rollout: ModelRollout, version: int, n: int, rng, scale=1.0, error_rate=0.0) -> None:
    window = rollout.window(version)
    for seconds, fails in zip(
        rng.lognormal(np.log(0.010), 0.3, n) * scale, rng.random(n) < error_rate, strict=True
    ):
        window.add(float(seconds), not fails)


def _compared(rollout: ModelRollout, n: int, cosine: float) -> None:
    """n mirrored requests that both versions answered, with this output cosine."""
    for _ in range(n):
        rollout.comparisons.add(Record(1, 2, 10, 10, True, True, outputs={"y": {"cosine": cosine}}))


def _candidate(rollout: ModelRollout, role: str = "canary") -> dict:
    report = verdict.report(rollout.snapshot())
    return next(c for c in report["candidates"] if c["role"] == role)


TRAFFIC = Traffic(stable=1, canary=2, canary_weight=10)


def test_too_few_requests_keep_watching_and_say_how_many_more():
    rollout, rng = _rollout(TRAFFIC), np.random.default_rng(0)
    _feed(rollout, 1, 300, rng)
    _feed(rollout, 2, 30, rng)
    c = _candidate(rollout)
    assert c["recommendation"] == "keep watching"
    assert c["more_requests_needed"] == c["requests_needed_per_version"] - 30 > 0
    assert "more needed" in c["reasons"][0] and "at 10%" in c["reasons"][0]


def test_enough_requests_and_no_harm_promote():
    rollout, rng = _rollout(TRAFFIC), np.random.default_rng(1)
    _feed(rollout, 1, 6000, rng, error_rate=0.001)
    _feed(rollout, 2, 6000, rng, error_rate=0.001)
    c = _candidate(rollout)
    assert c["more_requests_needed"] == 0
    assert c["recommendation"] == "promote", c["reasons"]


def test_a_slower_or_failing_canary_is_rolled_back():
    rng = np.random.default_rng(2)
    slow = _rollout(TRAFFIC)
    _feed(slow, 1, 2000, rng)
    _feed(slow, 2, 600, rng, scale=1.3)
    c = _candidate(slow)
    assert c["recommendation"] == "roll back"
    assert any("mean latency" in r for r in c["reasons"])
    failing = _rollout(TRAFFIC)
    _feed(failing, 1, 2000, rng, error_rate=0.01)
    _feed(failing, 2, 600, rng, error_rate=0.08)
    c = _candidate(failing)
    assert c["recommendation"] == "roll back" and "error rate" in c["reasons"][0]


def test_a_shadow_whose_outputs_disagree_is_rolled_back():
    rollout, rng = _rollout(Traffic(stable=1, shadow=2)), np.random.default_rng(3)
    _feed(rollout, 1, 3000, rng)
    _feed(rollout, 2, 3000, rng)
    _compared(rollout, 50, cosine=0.9)
    c = _candidate(rollout, "shadow")
    assert c["recommendation"] == "roll back"
    assert "mean cosine 0.9000 is below 0.99" in c["reasons"][0]


def test_report_lists_every_version_with_intervals_and_their_method():
    rollout, rng = _rollout(TRAFFIC), np.random.default_rng(4)
    _feed(rollout, 1, 2000, rng)
    _feed(rollout, 2, 20, rng)
    versions = {v["version"]: v for v in verdict.report(rollout.snapshot())["versions"]}
    assert versions["1"]["latency_ms"]["p99"]["method"] == "normal"  # 2000 * .01 * .99 >= 10
    assert versions["2"]["latency_ms"]["mean"]["method"] == "bootstrap"  # 20 < 30
    for v in versions.values():
        for figure in v["latency_ms"].values():
            assert figure["low"] <= figure["value"] <= figure["high"]


def test_a_shadow_with_too_few_compared_answers_is_kept_watching():
    rollout, rng = _rollout(Traffic(stable=1, shadow=2)), np.random.default_rng(5)
    _feed(rollout, 1, 6000, rng)
    _feed(rollout, 2, 6000, rng)
    _compared(rollout, 10, cosine=1.0)
    c = _candidate(rollout, "shadow")
    assert c["recommendation"] == "keep watching" and "only 10 mirrored" in c["reasons"][0]
    _compared(rollout, 30, cosine=1.0)
    assert _candidate(rollout, "shadow")["recommendation"] == "promote"


def test_promote_needs_the_requests_the_p99_test_needs():
    rollout = _rollout(Traffic(stable=1, canary=2, latency_effect=0.5, error_effect=0.2))
    rng = np.random.default_rng(6)
    _feed(rollout, 1, 450, rng)
    _feed(rollout, 2, 450, rng)
    c = _candidate(rollout)
    assert c["requests_needed_per_version"] == 500 and c["recommendation"] == "keep watching"


def test_with_no_real_difference_the_verdict_rarely_says_roll_back():
    """A canary identical to stable: 'roll back' at most about alpha of the time."""
    runs, alpha = 200, 0.05
    rng = np.random.default_rng(7)
    rolled = 0
    for _ in range(runs):
        traffic = Traffic(stable=1, canary=2, canary_weight=10, alpha=alpha)
        rollout = _rollout(traffic)
        _feed(rollout, 1, 1000, rng, error_rate=0.02)
        _feed(rollout, 2, 600, rng, error_rate=0.02)
        stable, canary = rollout.window(1), rollout.window(2)
        found = verdict.compare(traffic, "canary", 2, stable, canary, None)
        rolled += found["recommendation"] == "roll back"
    assert rolled <= sp.binom.ppf(0.995, runs, alpha), rolled
