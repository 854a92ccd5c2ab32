"""The automatic rollback rule: it catches a bad canary, and with no real difference it
rolls back at most about `alpha` of the time, however often it looks."""

from __future__ import annotations

import numpy as np
from scipy import stats as sp

from bitserve.config import RollbackRule
from bitserve.rollout import guard, stats
from bitserve.rollout.window import Window


def _run(rule: RollbackRule, rng, canary_error=0.01, canary_slow=1.0, canary_n=1000) -> int | None:
    """Simulate a canary at 50% weight; the canary request count at rollback, or None."""
    stable, canary = Window(10_000), Window(10_000)
    s_lat = rng.lognormal(np.log(0.010), 0.4, canary_n)
    c_lat = rng.lognormal(np.log(0.010), 0.4, canary_n) * canary_slow
    s_ok = rng.random(canary_n) >= 0.01
    c_ok = rng.random(canary_n) >= canary_error
    looks = 0
    for i in range(canary_n):
        stable.add(s_lat[i], s_ok[i])
        canary.add(c_lat[i], c_ok[i])
        if (i + 1) % rule.check_every == 0 and guard.ready(rule, stable, canary):
            looks += 1
            if guard.check(rule, looks, stable, canary):
                return i + 1
    return None


def test_a_canary_with_more_errors_is_rolled_back():
    rule = RollbackRule(alpha=0.01, min_requests=100, check_every=50)
    rng = np.random.default_rng(3)
    at = _run(rule, rng, canary_error=0.10)
    assert at is not None and at <= 300


def test_a_canary_with_a_slow_tail_is_rolled_back():
    rule = RollbackRule(alpha=0.01, min_requests=200, check_every=50)
    rng = np.random.default_rng(4)
    at = _run(rule, rng, canary_slow=2.0)
    assert at is not None and at <= 600  # the tail test starts at 500


def test_false_rollback_rate_with_no_real_difference_stays_at_most_alpha():
    """300 simulated canaries no worse than stable, each checked 17 times."""
    alpha, runs = 0.05, 300
    rule = RollbackRule(alpha=alpha, min_requests=200, check_every=50)
    rng = np.random.default_rng(5)
    rolled = sum(_run(rule, rng) is not None for _ in range(runs))
    # at most alpha, within the binomial 99% band of `runs` trials
    assert rolled <= sp.binom.ppf(0.995, runs, alpha), rolled


def test_each_look_alone_is_calibrated_near_alpha():
    """The error-rate z-test at one look rejects a true null about alpha of the time."""
    alpha, runs, n = 0.05, 2000, 2000
    rng = np.random.default_rng(6)
    rejected = sum(
        stats.two_proportions(rng.binomial(n, 0.05), n, rng.binomial(n, 0.05), n).p_value < alpha
        for _ in range(runs)
    )
    assert sp.binom.ppf(0.005, runs, alpha) <= rejected <= sp.binom.ppf(0.995, runs, alpha)
    rejected = sum(
        stats.exceedance(rng.lognormal(0, 0.4, n), rng.lognormal(0, 0.4, n), 0.95).p_value < alpha
        for _ in range(runs // 4)
    )
    assert rejected <= sp.binom.ppf(0.995, runs // 4, alpha)
