"""The automatic rollback rule: stop a canary that is significantly worse than stable.

Every `check_every` canary requests, once stable and canary each have `min_requests`
in their windows, two one-sided tests run: the canary's error rate against stable's
(two-proportion z) and its upper tail against stable's (the share above stable's p99,
the same z-test; it needs 500 requests per version, 5 expected above the p99). Either
significant rolls the canary back to weight 0.

Looking again and again at accumulating data inflates false alarms (the "peeking"
problem). The k-th check therefore spends alpha * 6 / (pi^2 k^2), split between the two
tests: summed over any number of checks that is at most alpha, so a canary no worse than
stable is rolled back with probability at most `alpha`. The price is that each later
check needs stronger evidence; a canary much worse than stable is still caught quickly.
Only the standard library's normal distribution is used: this runs on the request path.
"""

from __future__ import annotations

import numpy as np

from bitserve.config import RollbackRule
from bitserve.rollout.stats import alpha_at_look, exceedance, two_proportions
from bitserve.rollout.window import Window


def ready(rule: RollbackRule, stable: Window, canary: Window) -> bool:
    return len(stable) >= rule.min_requests and len(canary) >= rule.min_requests


def check(rule: RollbackRule, look: int, stable: Window, canary: Window) -> str | None:
    """Why the canary must be rolled back at this (1-based) look, or None."""
    alpha = alpha_at_look(rule.alpha, look) / 2
    e_s, n_s = stable.window_errors(), len(stable)
    e_c, n_c = canary.window_errors(), len(canary)
    test = two_proportions(e_s, n_s, e_c, n_c)
    if test is not None and test.p_value < alpha:
        return (
            f"canary error rate {e_c / n_c:.2%} vs stable {e_s / n_s:.2%} "
            f"(z = {test.statistic:.2f}, p = {test.p_value:.2g} < {alpha:.2g} at check {look})"
        )
    a, b = stable.latencies(), canary.latencies()
    test = exceedance(a, b, 0.99)
    if test is not None and test.p_value < alpha:
        p99_a, p99_b = np.quantile(a, 0.99) * 1000, np.quantile(b, 0.99) * 1000
        return (
            f"canary p99 {p99_b:.1f} ms vs stable {p99_a:.1f} ms: its tail above stable's "
            f"p99 is heavier (z = {test.statistic:.2f}, p = {test.p_value:.2g} < {alpha:.2g} "
            f"at check {look})"
        )
    return None
