"""The tool's numbers equal numpy's on recorded samples, with vLLM's definitions."""

from __future__ import annotations

import numpy as np
import pytest

from bitserve.loadtest.loadgen import Load, Run
from bitserve.loadtest.metrics import parse_goodput, summarise
from bitserve.loadtest.stream import Result


def recorded(n: int = 500, seed: int = 1) -> Run:
    rng = np.random.default_rng(seed)
    results = []
    for i in range(n):
        ttft = float(rng.gamma(2.0, 0.02))
        out = int(rng.integers(1, 40))
        itl = [float(v) for v in rng.exponential(0.01, size=out - 1)]
        results.append(
            Result(
                start=i * 0.01,
                latency=ttft + sum(itl),
                ttft=ttft,
                itl=itl,
                prompt_len=int(rng.integers(10, 100)),
                output_len=out,
            )
        )
    results.append(Result(start=0.0, latency=1.0, error="http_503"))
    results.append(Result(start=0.0, latency=60.0, error="timeout"))
    return Run(Load(concurrency=4, num_requests=n), results, duration=7.5)


def test_distributions_and_throughputs_equal_numpy():
    run = recorded()
    s = summarise(run)
    done = [r for r in run.results if r.ok]
    e2el = np.array([r.latency for r in done]) * 1e3
    ttft = np.array([r.ttft for r in done]) * 1e3
    tpot = np.array([(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1])
    itl = np.array([g for r in done for g in r.itl]) * 1e3
    for key, ref in (("e2el", e2el), ("ttft", ttft), ("tpot", tpot * 1e3), ("itl", itl)):
        assert s[key]["mean_ms"] == pytest.approx(ref.mean(), rel=1e-12)
        assert s[key]["median_ms"] == pytest.approx(np.median(ref), rel=1e-12)
        assert s[key]["std_ms"] == pytest.approx(ref.std(), rel=1e-12)
        for p in (90, 99):
            assert s[key][f"p{p}_ms"] == pytest.approx(np.percentile(ref, p), rel=1e-12)
    assert s["completed"] == len(done) and s["failed"] == 2
    assert s["errors"] == {"http_503": 1, "timeout": 1}
    assert s["request_throughput"] == pytest.approx(len(done) / 7.5)
    out = sum(r.output_len for r in done)
    inp = sum(r.prompt_len for r in done)
    assert s["output_throughput"] == pytest.approx(out / 7.5)
    assert s["input_throughput"] == pytest.approx(inp / 7.5)
    assert s["total_token_throughput"] == pytest.approx((inp + out) / 7.5)


def test_goodput_counts_requests_meeting_every_slo():
    run = recorded()
    slos = parse_goodput(["ttft:40", "tpot:12"])
    assert slos == {"ttft": 0.04, "tpot": 0.012}
    done = [r for r in run.results if r.ok]
    met = sum(
        r.ttft <= 0.04 and (r.output_len <= 1 or (r.latency - r.ttft) / (r.output_len - 1) <= 0.012)
        for r in done
    )
    s = summarise(run, slos)
    assert 0 < met < len(done)
    assert s["goodput"]["requests"] == met
    assert s["request_goodput"] == pytest.approx(met / 7.5)


def test_bad_goodput_spec_is_refused():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
