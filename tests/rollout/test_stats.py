"""bitserve/rollout/stats.py against scipy, on synthetic samples with known differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sp

from bitserve.rollout import stats


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def test_welch_and_mann_whitney_match_scipy_and_see_a_known_difference(rng):
    a = rng.lognormal(np.log(10), 0.3, 400)  # stable: ~10 ms, skewed
    b = rng.lognormal(np.log(11), 0.3, 300)  # candidate: 10% slower
    welch = stats.welch(a, b)
    ref = sp.ttest_ind(b, a, equal_var=False, alternative="greater")
    assert welch.statistic == pytest.approx(ref.statistic)
    assert welch.p_value == pytest.approx(ref.pvalue)
    assert welch.p_two_sided == pytest.approx(sp.ttest_ind(b, a, equal_var=False).pvalue)
    assert welch.p_value < 1e-4  # the known difference is found
    assert stats.welch(b, a).p_value > 0.99  # and only in the right direction
    mw = stats.mann_whitney(a, b)
    ref = sp.mannwhitneyu(b, a, alternative="greater", method="asymptotic")
    assert mw.p_value == pytest.approx(ref.pvalue)
    assert mw.p_value < 1e-4


def test_two_proportions_matches_the_chi_square_test():
    # 12 errors in 1000 against 30 in 1000
    test = stats.two_proportions(12, 1000, 30, 1000)
    chi2, p, _, _ = sp.chi2_contingency([[12, 988], [30, 970]], correction=False)
    assert test.statistic**2 == pytest.approx(chi2)
    assert test.p_two_sided == pytest.approx(p)
    assert test.p_value == pytest.approx(sp.norm.sf(test.statistic))
    assert stats.two_proportions(0, 100, 0, 100).p_value == 0.5  # no errors: no evidence


def test_wilson_interval_matches_scipy():
    for k, n in ((0, 50), (3, 200), (40, 100)):
        ours = stats.wilson(k, n, 0.95)
        ref = sp.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert (ours.low, ours.high) == pytest.approx((ref.low, ref.high), abs=1e-9)


def test_mean_interval_is_normal_when_large_and_bootstrap_when_small(rng):
    x = rng.exponential(5.0, 500)
    ours = stats.mean_interval(x, 0.95)
    ref = sp.norm.interval(0.95, loc=x.mean(), scale=sp.sem(x))
    assert ours.method == "normal"
    assert (ours.low, ours.high) == pytest.approx(ref, rel=1e-9)
    small = x[:12]
    ours = stats.mean_interval(small, 0.95)
    ref = sp.bootstrap(
        (small,), np.mean, confidence_level=0.95, method="percentile", rng=1, n_resamples=4000
    ).confidence_interval
    assert ours.method == "bootstrap"
    width = ref.high - ref.low
    assert abs(ours.low - ref.low) < 0.1 * width and abs(ours.high - ref.high) < 0.1 * width


def test_quantile_interval_agrees_with_scipy_quantile_test(rng):
    x = rng.lognormal(0, 0.5, 5000)
    ordered = np.sort(x)
    for q in (0.5, 0.95, 0.99):
        ours = stats.quantile_interval(x, q, 0.95)
        assert ours.method == "normal"
        ref = sp.quantile_test(x, q=np.quantile(x, q), p=q).confidence_interval(0.95)
        ranks = [np.searchsorted(ordered, v) for v in (ours.low, ours.high, ref.low, ref.high)]
        assert abs(ranks[0] - ranks[2]) <= 2 and abs(ranks[1] - ranks[3]) <= 2
        assert ours.low <= ours.value <= ours.high
    assert stats.quantile_interval(x[:200], 0.99).method == "bootstrap"  # n q (1-q) = 2


def test_difference_interval_matches_welch_confidence_interval(rng):
    a, b = rng.normal(10, 2, 2000), rng.normal(10.5, 3, 1500)
    ours = stats.difference_interval(a, b, 0.95)
    ref = sp.ttest_ind(b, a, equal_var=False).confidence_interval(0.95)
    assert (ours.low, ours.high) == pytest.approx((ref.low, ref.high), rel=2e-3)
    assert ours.low > 0  # the known 0.5 difference


def test_exceedance_finds_a_heavier_tail_and_is_the_z_test_on_counts(rng):
    a = rng.lognormal(0, 0.3, 3000)
    b = np.concatenate([rng.lognormal(0, 0.3, 2900), rng.lognormal(1.5, 0.3, 100)])
    test = stats.exceedance(a, b, 0.99)
    threshold = np.quantile(a, 0.99)
    ref = stats.two_proportions(int((a > threshold).sum()), 3000, int((b > threshold).sum()), 3000)
    assert test.p_value == pytest.approx(ref.p_value)
    assert test.p_value < 1e-6
    assert stats.exceedance(b, a, 0.99).p_value > 0.99


def test_sample_size_gives_the_requested_power(rng):
    """At n_for_means per group, Welch's one-sided test finds the effect ~80% of the time."""
    sd, delta, alpha, power = 2.0, 0.5, 0.05, 0.8
    n = stats.n_for_means(sd, sd, delta, alpha, power)
    assert n == math.ceil((sp.norm.ppf(1 - alpha) + sp.norm.ppf(power)) ** 2 * 2 * sd**2 / delta**2)
    runs = 400
    hits = sum(
        sp.ttest_ind(rng.normal(delta, sd, n), rng.normal(0, sd, n), alternative="greater").pvalue
        < alpha
        for _ in range(runs)
    )
    assert abs(hits / runs - power) < 0.06
    n = stats.n_for_proportions(0.01, 0.03, alpha, power)
    hits = sum(
        stats.two_proportions(rng.binomial(n, 0.01), n, rng.binomial(n, 0.03), n).p_value < alpha
        for _ in range(runs)
    )
    assert abs(hits / runs - power) < 0.07


def test_alpha_spending_sums_to_alpha():
    assert sum(stats.alpha_at_look(0.05, k) for k in range(1, 100_000)) == pytest.approx(
        0.05, rel=1e-4
    )
