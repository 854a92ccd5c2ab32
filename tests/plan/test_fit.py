"""MLE fits: known parameters recovered within their confidence intervals, the true
family picked by AIC where families are clearly apart, and a warning when none fits."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

from bitserve.cli import main
from bitserve.plan import fit

TRUE = {  # family -> (scipy distribution, its parameters by our names)
    "exponential": (stats.expon(scale=0.05), {"scale": 0.05}),
    "gamma": (stats.gamma(3.0, scale=2.0), {"shape": 3.0, "scale": 2.0}),
    "weibull": (stats.weibull_min(0.6, scale=2.0), {"shape": 0.6, "scale": 2.0}),
    "lognormal": (stats.lognorm(0.5, scale=20.0), {"sigma": 0.5, "scale": 20.0}),
}


@pytest.mark.parametrize("family", sorted(TRUE))
def test_parameters_recovered_within_confidence_intervals(family):
    """Over 40 samples of 1,000 the 95% intervals should cover the truth ~95% of the time."""
    dist, params = TRUE[family]
    rng = np.random.default_rng(7)
    covered, runs = 0, 40
    for _ in range(runs):
        result = fit.fit_family(family, dist.rvs(size=1000, random_state=rng))
        covered += all(lo <= params[k] <= hi for k, (lo, hi) in
                       ((k, result.interval(k)) for k in params))  # fmt: skip
    assert covered >= 0.8 * runs


@pytest.mark.parametrize("family", ["gamma", "weibull", "lognormal"])
def test_aic_picks_the_true_family(family):
    dist, _ = TRUE[family]
    sample = dist.rvs(size=3000, random_state=np.random.default_rng(3))
    fits = fit.fit_all(sample)
    assert fits[0].family == family
    assert fits[1].aic - fits[0].aic > 10
    assert fit.warning(fits) is None


def test_exponential_is_not_beaten_by_its_generalisations():
    """gamma and Weibull contain the exponential: they may win by < 2 AIC, never more."""
    sample = TRUE["exponential"][0].rvs(size=3000, random_state=np.random.default_rng(3))
    fits = {f.family: f for f in fit.fit_all(sample)}
    assert fits["exponential"].aic - min(f.aic for f in fits.values()) < 2


def test_warns_when_no_family_fits():
    rng = np.random.default_rng(0)
    bimodal = np.concatenate([rng.normal(10, 0.5, 1500), rng.normal(50, 1, 1500)])
    fits = fit.fit_all(bimodal, fit.LATENCY_FAMILIES)
    assert "no family fits" in fit.warning(fits)


def test_cli_fits_an_access_log_and_draws_pngs(tmp_path):
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.gamma(2.0, 0.01, 800))
    latency = rng.lognormal(np.log(20), 0.4, 800)
    log = tmp_path / "access.log"
    lines = [json.dumps({"time": a + d / 1e3, "model": "m", "version": "1", "status": 200,
                         "duration_ms": d, "queue_ms": 1.0, "compute_ms": d - 1.0,
                         "batch_size": 1, "rows": 1})
             for a, d in zip(arrivals, latency, strict=True)]  # fmt: skip
    log.write_text("\n".join(lines) + "\nnot json\n")
    answer = CliRunner().invoke(main, ["plan", "fit", str(log), "--report-dir", str(tmp_path)])
    assert answer.exit_code == 0, answer.output
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert saved["arrivals"]["fits"][0]["family"] == "gamma"
    assert saved["latency"]["fits"][0]["family"] == "lognormal"
    assert "KS D" in answer.output and "AIC" in answer.output
    for png in ("arrivals.png", "latency.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
