"""The statistics behind a rollout verdict: intervals, tests, sample sizes.

Why the comparison of two means is valid at all: by the Central Limit Theorem the mean
of n latencies is close to normal for large n, whatever the latency distribution looks
like (and latencies are skewed). For a handful of requests it is not, so an interval
says how it was made: "normal" where the sample is large enough, "bootstrap" (the
percentile bootstrap, seeded, so a report is reproducible) otherwise.

The normal distribution comes from the standard library, so the request path (the
automatic rollback check) never imports scipy; the t-test and Mann-Whitney U in the
report do, lazily.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

NORMAL = NormalDist()
MIN_NORMAL_MEAN = 30  # below this many samples a mean's interval is bootstrapped
MIN_NORMAL_QUANTILE = 10  # n q (1 - q) needed for the normal order-statistic interval
BOOTSTRAP_RESAMPLES = 2000
MIN_EXCEEDANCES = 5  # expected per sample before the tail test runs


@dataclass
class Interval:
    value: float
    low: float
    high: float
    method: str  # normal | bootstrap | wilson

    def as_dict(self, scale: float = 1.0) -> dict:
        out = asdict(self)
        for key in ("value", "low", "high"):
            out[key] = round(out[key] * scale, 6)
        return out


@dataclass
class Test:
    statistic: float
    p_value: float  # one-sided: the candidate is worse (larger)
    p_two_sided: float
    name: str

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def z(level: float) -> float:
    """The two-sided normal quantile for a confidence level (0.95 -> 1.96)."""
    return NORMAL.inv_cdf(0.5 + level / 2)


# ------------------------------------------------------------------ intervals


def mean_interval(x: np.ndarray, level: float = 0.95, seed: int = 0) -> Interval | None:
    """The mean with its interval: normal (CLT) from 30 samples, bootstrap below."""
    n = len(x)
    if n < 2:
        return None
    mean = float(np.mean(x))
    if n >= MIN_NORMAL_MEAN:
        half = z(level) * float(np.std(x, ddof=1)) / math.sqrt(n)
        return Interval(mean, mean - half, mean + half, "normal")
    low, high = _bootstrap(x, lambda rows: rows.mean(axis=1), level, seed)
    return Interval(mean, low, high, "bootstrap")


def quantile_interval(
    x: np.ndarray, q: float, level: float = 0.95, seed: int = 0
) -> Interval | None:
    """A quantile with a distribution-free interval between two order statistics.

    The count of samples below the true q-quantile is Binomial(n, q); where n q (1 - q)
    is large enough that count is near normal, and the interval's ends are the order
    statistics at ranks n q -/+ z sqrt(n q (1 - q)). Below that, bootstrap."""
    n = len(x)
    if n < 2:
        return None
    ordered = np.sort(x)
    value = float(np.quantile(ordered, q))
    spread = n * q * (1 - q)
    if spread >= MIN_NORMAL_QUANTILE:
        half = z(level) * math.sqrt(spread)
        low = max(math.floor(n * q - half), 0)
        high = min(math.ceil(n * q + half), n - 1)
        return Interval(value, float(ordered[low]), float(ordered[high]), "normal")
    low_v, high_v = _bootstrap(x, lambda rows: np.quantile(rows, q, axis=1), level, seed)
    return Interval(value, low_v, high_v, "bootstrap")


def wilson(errors: int, n: int, level: float = 0.95) -> Interval | None:
    """A proportion's Wilson score interval: sound at 0 errors and small n, where the
    plain normal (Wald) interval collapses to a point."""
    if n == 0:
        return None
    p, zz = errors / n, z(level)
    centre = (p + zz * zz / (2 * n)) / (1 + zz * zz / n)
    half = zz * math.sqrt(p * (1 - p) / n + zz * zz / (4 * n * n)) / (1 + zz * zz / n)
    return Interval(p, max(centre - half, 0.0), min(centre + half, 1.0), "wilson")


def difference_interval(a: np.ndarray, b: np.ndarray, level: float = 0.95) -> Interval | None:
    """mean(b) - mean(a) with Welch's normal interval (both samples large) or bootstrap."""
    if len(a) < 2 or len(b) < 2:
        return None
    diff = float(np.mean(b) - np.mean(a))
    if min(len(a), len(b)) >= MIN_NORMAL_MEAN:
        se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
        return Interval(diff, diff - z(level) * se, diff + z(level) * se, "normal")
    rng = np.random.default_rng(0)
    diffs = rng.choice(b, (BOOTSTRAP_RESAMPLES, len(b))).mean(axis=1) - rng.choice(
        a, (BOOTSTRAP_RESAMPLES, len(a))
    ).mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(diffs, [tail, 100 - tail])
    return Interval(diff, float(low), float(high), "bootstrap")


def _bootstrap(x: np.ndarray, statistic, level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap; `statistic` maps a (resamples, n) matrix to one value
    per row, so all resamples are computed at once."""
    rng = np.random.default_rng(seed)
    values = statistic(rng.choice(x, size=(BOOTSTRAP_RESAMPLES, len(x)), replace=True))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


# ---------------------------------------------------------------------- tests


def two_proportions(k_a: int, n_a: int, k_b: int, n_b: int) -> Test | None:
    """The pooled two-proportion z-test; the one-sided p is for b's rate above a's."""
    if n_a == 0 or n_b == 0:
        return None
    pooled = (k_a + k_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:  # no errors (or only errors) in both: no evidence either way
        return Test(0.0, 0.5, 1.0, "two-proportion z")
    stat = (k_b / n_b - k_a / n_a) / se
    return Test(stat, NORMAL.cdf(-stat), 2 * NORMAL.cdf(-abs(stat)), "two-proportion z")


def exceedance(a: np.ndarray, b: np.ndarray, q: float = 0.99) -> Test | None:
    """Is b's upper tail heavier than a's? The share of each sample above a's
    q-quantile, compared with the two-proportion z-test. Under no difference both shares
    are about 1 - q, and the variance of b's share (binomial, plus the error of a's
    estimated quantile) is what the pooled z-test assumes. Cheap enough for the request
    path: no resampling. None until each sample expects `MIN_EXCEEDANCES` values above
    the quantile (500 requests for the p99): with fewer the z approximation is wrong."""
    if min(len(a), len(b)) * (1 - q) < MIN_EXCEEDANCES - 1e-9:
        return None
    threshold = np.quantile(a, q)
    result = two_proportions(int(np.sum(a > threshold)), len(a), int(np.sum(b > threshold)), len(b))
    assert result is not None
    result.name = f"p{round(q * 100)} exceedance z"
    return result


def welch(a: np.ndarray, b: np.ndarray) -> Test | None:
    """Welch's t-test on means (no equal-variance assumption); one-sided p: b slower."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy import stats  # lazily: only a report needs it

    greater = stats.ttest_ind(b, a, equal_var=False, alternative="greater")
    both = stats.ttest_ind(b, a, equal_var=False)
    return Test(
        _finite(greater.statistic),
        _finite(greater.pvalue, 1.0),
        _finite(both.pvalue, 1.0),
        "Welch t",
    )


def mann_whitney(a: np.ndarray, b: np.ndarray) -> Test | None:
    """Mann-Whitney U (no normality needed; asymptotic with tie correction); one-sided
    p: b's latencies tend to be larger."""
    if len(a) < 2 or len(b) < 2:
        return None
    from scipy import stats

    greater = stats.mannwhitneyu(b, a, alternative="greater", method="asymptotic")
    both = stats.mannwhitneyu(b, a, alternative="two-sided", method="asymptotic")
    return Test(
        float(greater.statistic), float(greater.pvalue), float(both.pvalue), "Mann-Whitney U"
    )


def _finite(value: float, default: float = 0.0) -> float:
    value = float(value)
    return value if math.isfinite(value) else default


# ---------------------------------------------------------------- sample size


def n_for_means(sd_a: float, sd_b: float, delta: float, alpha: float, power: float) -> int:
    """Requests per version for a one-sided test at `alpha` to detect a mean
    difference `delta` with probability `power` (normal approximation)."""
    if delta <= 0:
        return 0
    zz = NORMAL.inv_cdf(1 - alpha) + NORMAL.inv_cdf(power)
    return math.ceil(zz * zz * (sd_a * sd_a + sd_b * sd_b) / (delta * delta))


def n_for_proportions(p_a: float, p_b: float, alpha: float, power: float) -> int:
    """Requests per version to detect an error rate p_b against p_a (one-sided)."""
    if p_b <= p_a:
        return 0
    z_a, z_b = NORMAL.inv_cdf(1 - alpha), NORMAL.inv_cdf(power)
    mean = (p_a + p_b) / 2
    top = z_a * math.sqrt(2 * mean * (1 - mean)) + z_b * math.sqrt(
        p_a * (1 - p_a) + p_b * (1 - p_b)
    )
    return math.ceil(top * top / ((p_b - p_a) ** 2))


def alpha_at_look(alpha: float, look: int) -> float:
    """The share of `alpha` the k-th look at the data may spend: the shares sum to
    alpha over any number of looks (sum of 1/k^2 is pi^2/6), so checking again and
    again ("peeking") cannot push the false alarm rate above alpha."""
    return alpha * 6 / (math.pi**2 * look * look)
