"""The capacity simulation: exact against queueing theory where it applies, and within
25% of a real server's p99 under open-loop Poisson load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bitserve.cli import main
from bitserve.config import DynamicBatching
from bitserve.plan import capacity
from tests.conftest import Server, write_model

# A python model whose batch takes 8 ms + 2 ms per row: a known batch latency profile.
SLEEPER = """
import time

class Model:
    def predict(self, inputs):
        time.sleep(0.008 + 0.002 * len(inputs["x"]))
        return {"y": inputs["x"]}
"""
CONFIG = """
backend = "python"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [4]
[[output]]
name = "y"
datatype = "FP32"
dims = [4]
[dynamic_batching]
max_queue_delay_ms = 4
"""


def test_unbatched_queue_matches_pollaczek_khinchine():
    """M/D/1: mean wait = rho / (2 mu (1 - rho)); here 10 ms service at 60 req/s."""
    profile = capacity.Profile(10.0, 0.0)
    arrivals = capacity.Arrivals("exponential", {"scale": 1 / 60})
    times = arrivals.times(40000, np.random.default_rng(1))
    latency = capacity.simulate(times, profile, capacity.Batching())
    rho, mu = 0.6, 100.0
    expected_wait = rho / (2 * mu * (1 - rho))
    assert np.mean(latency[2000:]) - 0.010 == pytest.approx(expected_wait, rel=0.08)


def test_batches_follow_the_batcher_rules():
    """Arrivals every 1 ms and a 5 ms window: the first request leaves alone (idle
    dispatch), then batches fill to max_batch_size while the instance is busy."""
    profile = capacity.Profile(20.0, 0.0)
    batching = capacity.Batching(4, DynamicBatching(max_queue_delay_ms=5), 1)
    latency = capacity.simulate(np.arange(9) * 1e-3, profile, batching)
    assert latency[0] == pytest.approx(0.020)
    # requests 1-4 wait for the instance (free at 20 ms) and leave together
    assert latency[1:5] == pytest.approx([0.040 - t * 1e-3 for t in range(1, 5)])


def test_more_replicas_until_p99_meets_the_slo():
    profile = capacity.Profile(10.0, 2.0)
    batching = capacity.Batching(8, DynamicBatching(max_queue_delay_ms=4), 1)
    arrivals = capacity.Arrivals("exponential", {"scale": 1 / 400})
    tried, needed = capacity.replicas_needed(arrivals, profile, batching, 60.0, requests=5000)
    assert needed is not None and needed > 1
    assert tried[-1][1] <= 60.0 < tried[-2][1]


def run(*args: str) -> str:
    answer = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    return answer.output


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A real server: a closed-loop bench for the profile, one open-loop Poisson rate."""
    root = tmp_path_factory.mktemp("capacity")
    folder = write_model(root / "models", "sleeper", CONFIG, SLEEPER)
    log = root / "access.log"
    server = Server(root / "models", "--access-log", str(log))
    try:
        common = [server.url, "--model", "sleeper", "--no-plots", "--no-progress"]
        run("bench", *common, "--concurrency", "1,8", "--num-requests", "80",
            "--warmup", "8", "--report-dir", str(root / "profile"))  # fmt: skip
        closed_loop_lines = len(log.read_text().splitlines())
        run("bench", *common, "--rate", "80", "--num-requests", "500",
            "--report-dir", str(root / "open"))  # fmt: skip
    finally:
        server.stop()
    open_loop = root / "open.log"  # the Poisson part of the log only
    open_loop.write_text("".join(log.read_text().splitlines(True)[closed_loop_lines:]))
    return root, folder / "config.toml", open_loop


def test_simulated_p99_within_25_percent_of_measured(measured):
    root, config, _ = measured
    out = run(
        "plan", "capacity", "--profile", str(root / "profile" / "result.json"),
        "--rate", "80", "--slo", "100", "--model-config", str(config),
        "--validate", str(root / "open" / "result.json"),
    )  # fmt: skip
    print(out)
    profile = capacity.load_profile(root / "profile" / "result.json")
    assert profile.base_ms == pytest.approx(8.0, abs=4.0)
    assert profile.per_row_ms == pytest.approx(2.0, abs=1.0)
    point = json.loads((root / "open" / "result.json").read_text())["points"][0]
    measured_p99 = point["e2el"]["p99_ms"]
    simulated = float(out.split("simulated ")[-1].split(" ms")[0])
    assert simulated == pytest.approx(measured_p99, rel=0.25)
    assert "replicas needed: 1" in out


def test_fit_of_the_servers_own_log_feeds_capacity(measured, tmp_path):
    """Poisson arrivals logged by the server fit as exponential (or gamma with shape ~1)."""
    _, config, log = measured
    out = run("plan", "fit", str(log), "--report-dir", str(tmp_path))
    fits = json.loads((tmp_path / "fit.json").read_text())["arrivals"]["fits"]
    best = fits[0]
    assert best["family"] in ("exponential", "gamma", "weibull"), out
    assert best["params"].get("shape", 1.0) == pytest.approx(1.0, abs=0.2)
    for png in ("arrivals.png", "latency.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    out = run("plan", "capacity", "--profile", str(log), "--fit", str(tmp_path / "fit.json"),
              "--slo", "100", "--model-config", str(config))  # fmt: skip
    assert "replicas needed: 1" in out
