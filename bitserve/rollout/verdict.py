"""The rollout report: per version what it did, per candidate how it compares with
stable, and a plain recommendation.

- roll back: a test shows the candidate worse at `alpha` / 3 each (error rate:
  two-proportion z; mean latency: Welch's t; tail: the p99 exceedance test, from 500
  requests per version) by at least the configured effect, or a shadow's outputs
  agree less than `min_cosine` / `min_agreement`;
- promote: nothing is worse, and both versions have the requests a test needs to
  detect the configured effect with the configured power;
- keep watching: otherwise, saying how many more requests that takes.

Latency figures are in milliseconds over each version's window of latest requests
(successful ones); `requests` and `errors` count everything since the policy was loaded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bitserve.config import Traffic
from bitserve.rollout import stats
from bitserve.rollout.state import Snapshot
from bitserve.rollout.window import Window

MIN_COMPARED = 30  # mirrored pairs before output agreement can condemn a shadow
LEVEL = 0.95


def report(rollout: Snapshot) -> dict:
    """The whole report; pure, so it can run on a thread."""
    traffic = rollout.policy
    roles = {v: role for role, v in traffic.versions().items()}
    versions = sorted(set(rollout.windows) | set(roles))
    out: dict[str, Any] = {
        "model": rollout.name,
        "policy": traffic.model_dump(mode="json"),
        "confidence_level": LEVEL,
        "window": traffic.window,
        "versions": [describe(v, roles.get(v, "retired"), rollout.window(v)) for v in versions],
        "candidates": [],
        "shadow_comparison": rollout.comparisons,
        "events": rollout.events,
    }
    stable = rollout.window(traffic.stable)
    for role in ("canary", "shadow"):
        number = getattr(traffic, role)
        if number is not None:
            agreement = rollout.comparisons if role == "shadow" else None
            out["candidates"].append(
                compare(traffic, role, number, stable, rollout.window(number), agreement)
            )
    return out


def describe(version: int, role: str, window: Window) -> dict:
    ms = window.latencies() * 1000
    error_rate = stats.wilson(window.window_errors(), len(window), LEVEL)
    latency = {"mean": stats.mean_interval(ms, LEVEL)}
    for q in (50, 95, 99):
        latency[f"p{q}"] = stats.quantile_interval(ms, q / 100, LEVEL)
    return {
        "version": str(version),
        "role": role,
        "requests": window.requests,
        "errors": window.errors,
        "window_requests": len(window),
        "error_rate": error_rate.as_dict() if error_rate else None,
        "latency_ms": {k: (v.as_dict() if v else None) for k, v in latency.items()},
    }


def compare(
    traffic: Traffic,
    role: str,
    number: int,
    stable: Window,
    candidate: Window,
    agreement: dict | None,
) -> dict:
    a, b = stable.latencies() * 1000, candidate.latencies() * 1000
    e_a, n_a, e_b, n_b = (
        stable.window_errors(),
        len(stable),
        candidate.window_errors(),
        len(candidate),
    )
    tests = {
        "error_rate": stats.two_proportions(e_a, n_a, e_b, n_b),
        "latency_welch": stats.welch(a, b),
        "latency_mann_whitney": stats.mann_whitney(a, b),
        "latency_p99_exceedance": stats.exceedance(a, b, 0.99),
    }
    difference = stats.difference_interval(a, b, LEVEL)
    worse = _worse(traffic, tests, a, b, e_a, n_a, e_b, n_b)
    if agreement is not None:
        worse += _disagrees(traffic, agreement)
    needed = _needed(traffic, a, b, e_a, n_a)
    more = None if needed is None else max(needed - n_a, needed - n_b, 0)
    if worse:
        recommendation, reasons = "roll back", worse
    elif more is None or more > 0:
        recommendation = "keep watching"
        reasons = [_more_reason(traffic, role, needed, more)]
    elif agreement is not None and agreement["compared"] < MIN_COMPARED:
        recommendation = "keep watching"
        reasons = [
            f"only {agreement['compared']} mirrored requests compared with stable's "
            f"answers; {MIN_COMPARED} needed to judge the outputs"
        ]
    else:
        recommendation = "promote"
        reasons = [
            f"no significant harm at alpha {traffic.alpha:g} with {n_b} requests, enough to "
            f"detect a {traffic.latency_effect:.0%} latency or {traffic.error_effect:.1%} "
            f"error-rate rise with power {traffic.power:g}"
        ]
    return {
        "version": str(number),
        "role": role,
        "baseline": str(traffic.stable),
        "tests": {k: (t.as_dict() if t else None) for k, t in tests.items()},
        "latency_difference_ms": difference.as_dict() if difference else None,
        "agreement": agreement["outputs"] if agreement else None,
        "requests_needed_per_version": needed,
        "more_requests_needed": more,
        "recommendation": recommendation,
        "reasons": reasons,
    }


def _worse(
    traffic: Traffic, tests: dict, a: np.ndarray, b: np.ndarray, e_a: int, n_a: int, e_b, n_b
) -> list[str]:
    """Statistically and practically significant harm. Three tests can each raise a
    false alarm, so each runs at alpha / 3 (Bonferroni): together at most alpha."""
    alpha, reasons = traffic.alpha / 3, []
    t = tests["error_rate"]
    if t and t.p_value < alpha and e_b / n_b - e_a / n_a >= traffic.error_effect:
        reasons.append(
            f"error rate {e_b / n_b:.2%} vs stable {e_a / n_a:.2%} (p = {t.p_value:.2g})"
        )
    if len(a) and len(b):
        slower = traffic.latency_effect * float(np.mean(a))
        t = tests["latency_welch"]
        if t and t.p_value < alpha and np.mean(b) - np.mean(a) >= slower:
            reasons.append(
                f"mean latency {np.mean(b):.2f} ms vs stable {np.mean(a):.2f} ms "
                f"(Welch p = {t.p_value:.2g})"
            )
        t = tests["latency_p99_exceedance"]
        p99_a, p99_b = np.quantile(a, 0.99), np.quantile(b, 0.99)
        if t and t.p_value < alpha and p99_b >= p99_a * (1 + traffic.latency_effect):
            reasons.append(f"p99 {p99_b:.2f} ms vs stable {p99_a:.2f} ms (p = {t.p_value:.2g})")
    return reasons


def _disagrees(traffic: Traffic, agreement: dict) -> list[str]:
    if agreement["compared"] < MIN_COMPARED:
        return []
    reasons = []
    for name, figures in agreement["outputs"].items():
        for figure, bar in (
            ("cosine", traffic.min_cosine),
            ("top1_agreement", traffic.min_agreement),
            ("exact_match", traffic.min_agreement),
            ("box_agreement", traffic.min_agreement),
        ):
            if figure in figures and figures[figure]["mean"] < bar:
                mean = figures[figure]["mean"]
                reasons.append(f"output '{name}': mean {figure} {mean:.4f} is below {bar:g}")
        if "shape_mismatch" in figures:
            reasons.append(f"output '{name}': shapes differ from stable's")
    return reasons


def _needed(traffic: Traffic, a: np.ndarray, b: np.ndarray, e_a: int, n_a: int) -> int | None:
    """Requests per version for the configured power on both latency and error rate."""
    if len(a) < 2:
        return None
    sd_a = float(np.std(a, ddof=1))
    sd_b = float(np.std(b, ddof=1)) if len(b) >= 2 else sd_a
    delta = traffic.latency_effect * float(np.mean(a))
    latency = stats.n_for_means(sd_a, sd_b, delta, traffic.alpha, traffic.power)
    p_a = e_a / n_a if n_a else 0.0
    errors = stats.n_for_proportions(p_a, p_a + traffic.error_effect, traffic.alpha, traffic.power)
    return max(latency, errors, rollout_floor(traffic))


def rollout_floor(traffic: Traffic) -> int:
    """Never fewer than the CLT's usual 30, than the automatic rule's minimum, nor than
    the p99 tail test needs (5 expected above the p99: 500)."""
    tail = math.ceil(stats.MIN_EXCEEDANCES / (1 - 0.99))
    return max(stats.MIN_NORMAL_MEAN, traffic.rollback.min_requests, tail)


def _more_reason(traffic: Traffic, role: str, needed: int | None, more: int | None) -> str:
    if needed is None:
        return "not enough data: stable has fewer than 2 successful requests"
    text = (
        f"not enough data: {needed} requests per version detect a "
        f"{traffic.latency_effect:.0%} latency or {traffic.error_effect:.1%} error-rate rise "
        f"with power {traffic.power:g} at alpha {traffic.alpha:g}; about {more} more needed"
    )
    share = traffic.canary_weight if role == "canary" else traffic.shadow_percent
    if share and more:
        text += f" (about {round(more * 100 / share)} requests at {share:g}%)"
    return text
