"""Maximum-likelihood fits of candidate distribution families, ranked by AIC.

MLE finds the parameters that make the observed sample most probable *within a
family*; it cannot say whether the family is right. So every candidate is fitted, the
families are ranked by AIC (2k - 2 log L: likelihood, penalised for parameters), and
the best one is checked with a Kolmogorov-Smirnov test. The KS p-value is optimistic
when the parameters come from the same sample (Lilliefors), so a low one is a strong
sign that nothing in the list fits: then a warning says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

# name -> (scipy family, parameter names); location fixed at 0: times are positive.
FAMILIES = {
    "exponential": (stats.expon, ("scale",)),
    "gamma": (stats.gamma, ("shape", "scale")),
    "weibull": (stats.weibull_min, ("shape", "scale")),
    "lognormal": (stats.lognorm, ("sigma", "scale")),
}
ARRIVAL_FAMILIES = ("exponential", "gamma", "weibull", "lognormal")
LATENCY_FAMILIES = ("lognormal", "gamma", "weibull")
MIN_P_VALUE = 0.01  # below this for the best family: warn that nothing fits


@dataclass
class Fit:
    family: str
    params: dict[str, float]
    stderr: dict[str, float]  # from the observed Fisher information
    log_likelihood: float
    aic: float
    ks_statistic: float
    ks_p_value: float

    def frozen(self):
        """The fitted scipy distribution, for pdf/cdf/ppf/rvs."""
        dist, _ = FAMILIES[self.family]
        return dist(*self._shapes(), loc=0, scale=self.params["scale"])

    def _shapes(self) -> tuple[float, ...]:
        return tuple(v for k, v in self.params.items() if k != "scale")

    def interval(self, name: str, z: float = 1.96) -> tuple[float, float]:
        """A 95% Wald confidence interval for one parameter."""
        value, se = self.params[name], self.stderr[name]
        return value - z * se, value + z * se

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def fit_family(family: str, sample: np.ndarray) -> Fit:
    dist, names = FAMILIES[family]
    theta = dist.fit(sample, floc=0)
    values = [*theta[:-2], theta[-1]]  # drop loc: (shapes..., scale)
    loglik = float(np.sum(dist.logpdf(sample, *theta)))
    stderr = standard_errors(dist, sample, values)
    ks = stats.kstest(sample, dist.cdf, args=theta)
    return Fit(
        family=family,
        params=dict(zip(names, map(float, values), strict=True)),
        stderr=dict(zip(names, stderr, strict=True)),
        log_likelihood=loglik,
        aic=2 * len(names) - 2 * loglik,
        ks_statistic=float(ks.statistic),
        ks_p_value=float(ks.pvalue),
    )


def standard_errors(dist, sample: np.ndarray, values: list[float]) -> list[float]:
    """sqrt(diag(H^-1)), H the Hessian of the negative log-likelihood at the MLE, by
    central differences (the observed information: no closed form per family needed)."""
    values = np.asarray(values, dtype=float)

    def nll(v: np.ndarray) -> float:
        return -float(np.sum(dist.logpdf(sample, *v[:-1], loc=0, scale=v[-1])))

    k = len(values)
    steps = 1e-4 * np.maximum(np.abs(values), 1e-8)
    hessian = np.empty((k, k))
    for i in range(k):
        for j in range(k):
            ei, ej = np.eye(k)[i] * steps[i], np.eye(k)[j] * steps[j]
            hessian[i, j] = (
                nll(values + ei + ej) - nll(values + ei - ej)
                - nll(values - ei + ej) + nll(values - ei - ej)
            ) / (4 * steps[i] * steps[j])  # fmt: skip
    try:
        cov = np.linalg.inv(hessian)
    except np.linalg.LinAlgError:
        return [math.nan] * k
    return [float(math.sqrt(c)) if c > 0 else math.nan for c in np.diag(cov)]


def fit_all(sample, families=ARRIVAL_FAMILIES) -> list[Fit]:
    """Every family fitted, best (lowest AIC) first."""
    data = np.asarray(sample, dtype=float)
    data = data[np.isfinite(data) & (data > 0)]
    if len(data) < 10:
        raise ValueError(f"{len(data)} positive samples: too few to fit a distribution")
    return sorted((fit_family(f, data) for f in families), key=lambda f: f.aic)


def warning(fits: list[Fit]) -> str | None:
    """A sentence when even the best family fails the KS test."""
    best = fits[0]
    if best.ks_p_value >= MIN_P_VALUE:
        return None
    return (
        f"no family fits: the best by AIC ({best.family}) has KS D={best.ks_statistic:.3f}, "
        f"p={best.ks_p_value:.2g} < {MIN_P_VALUE}; treat the fit as a rough summary "
        "(mixture of loads? outliers? plot the histogram)"
    )
