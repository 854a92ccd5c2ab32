"""Canary and shadow traffic on a real `bitserve serve`, measured from the client."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy import stats as sp

from tests.conftest import XY_CONFIG, Server, write_model

TOKEN = "rollout-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}

# y = x * version; sleeps SLEEP seconds per batch; FAIL: raise on every batch
MODEL = """
import time

class Model:
    def setup(self, model_dir):
        self.scale = float(model_dir.name)

    def predict(self, inputs):
        time.sleep({sleep})
        if {fail}:
            raise RuntimeError("version {{}} is broken".format(self.scale))
        return {{"y": inputs["x"] * self.scale}}
"""


def _versions(root: Path, name: str, traffic: str, versions: dict[int, tuple[float, bool]]):
    config = XY_CONFIG + "[version_policy]\nall = true\n" + traffic
    folder = write_model(root, name, config)
    for number, (sleep, fail) in versions.items():
        (folder / str(number)).mkdir(exist_ok=True)
        (folder / str(number) / "model.py").write_text(MODEL.format(sleep=sleep, fail=fail))


@pytest.fixture(scope="module")
def canary_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("canary") / "models"
    # 5 ms of work each: with none, the canary's rarely woken worker thread alone made it
    # 10% slower than stable at sub-millisecond latencies, a real (if useless) regression
    _versions(root, "m", "[traffic]\nstable = 1\ncanary = 2\ncanary_weight = 10\n", {
        1: (0.005, False), 2: (0.005, False), 3: (0.005, False)
    })  # fmt: skip
    bad = "[traffic]\nstable = 1\ncanary = 2\ncanary_weight = 50\n"
    bad += "[traffic.rollback]\nalpha = 0.01\nmin_requests = 40\ncheck_every = 10\n"
    _versions(root, "bad", bad, {1: (0, False), 2: (0, True)})
    server = Server(root, "--admin-token", TOKEN)
    yield server
    server.stop()


def _infer(client: httpx.Client, path: str, headers: dict | None = None) -> httpx.Response:
    return client.post(path, json=BODY, headers=headers)


def test_canary_share_on_a_real_server_and_pinned_requests_stay_put(canary_server):
    n = 400
    with httpx.Client(base_url=canary_server.url, timeout=30) as client:
        answers = [_infer(client, "/v2/models/m/infer") for _ in range(n)]
        assert all(a.status_code == 200 for a in answers)
        versions = [a.json()["model_version"] for a in answers]
        assert all(
            a.json()["outputs"][0]["data"] == [float(v)]
            for a, v in zip(answers, versions, strict=True)
        )
        canary = versions.count("2")
        assert set(versions) == {"1", "2"}
        # 99.9%: the in-process test holds the 99% check over 2000 with a seeded draw
        assert sp.binom.ppf(0.0005, n, 0.1) <= canary <= sp.binom.ppf(0.9995, n, 0.1), canary
        for pinned in ("1", "2", "3"):
            for _ in range(30):
                by_path = _infer(client, f"/v2/models/m/versions/{pinned}/infer")
                by_header = _infer(client, "/v2/models/m/infer", {"bitserve-model-version": pinned})
                assert by_path.json()["model_version"] == pinned
                assert by_header.json()["model_version"] == pinned
        report = client.get("/v2/models/m/rollout").json()
    by_version = {v["version"]: v for v in report["versions"]}
    assert by_version["2"]["requests"] == canary  # pinned requests are not counted
    assert by_version["1"]["requests"] == n - canary
    assert by_version["1"]["latency_ms"]["p50"]["method"] == "normal"
    candidate = report["candidates"][0]
    assert candidate["role"] == "canary"
    assert candidate["recommendation"] == "keep watching", candidate
    assert candidate["more_requests_needed"] > 0
    assert "more needed" in candidate["reasons"][0]


def test_traffic_admin_api_promote_rollback_and_metrics(canary_server):
    with httpx.Client(base_url=canary_server.url, timeout=30) as client:
        path = "/v2/repository/models/m/traffic"
        assert client.get(path).status_code == 401
        assert client.get(path, headers=AUTH).json()["canary_weight"] == 10
        wrong = client.patch(path, json={"canary": 7}, headers=AUTH)
        assert wrong.status_code == 400 and "traffic.canary" in wrong.json()["error"]
        assert client.patch(path, json={"canary_weight": 100}, headers=AUTH).status_code == 200
        assert {
            _infer(client, "/v2/models/m/infer").json()["model_version"] for _ in range(20)
        } == {"2"}
        metrics = client.get("/metrics").text
        assert 'bitserve_rollout_canary_weight_percent{model="m",version="2"} 100.0' in metrics
        back = client.post(path + "/rollback", headers=AUTH).json()
        assert back["canary_weight"] == 0
        assert {
            _infer(client, "/v2/models/m/infer").json()["model_version"] for _ in range(20)
        } == {"1"}
        client.patch(path, json={"canary_weight": 10}, headers=AUTH)
        promoted = client.post(path + "/promote", headers=AUTH).json()
        assert (promoted["stable"], promoted["canary"]) == (2, None)
        assert {
            _infer(client, "/v2/models/m/infer").json()["model_version"] for _ in range(20)
        } == {"2"}
        events = [e["action"] for e in client.get("/v2/models/m/rollout").json()["events"]]
        assert events[-3:] == ["rollback", "set", "promote"]
        assert client.delete(path, headers=AUTH).status_code == 200
        assert client.get(path, headers=AUTH).json() is None
        assert client.get("/v2/models/m/rollout").status_code == 404
        # no policy: the highest version answers, as without a [traffic] table
        assert _infer(client, "/v2/models/m/infer").json()["model_version"] == "3"
        assert 'bitserve_rollout_canary_weight_percent{model="m"' not in client.get("/metrics").text


def test_a_failing_canary_is_rolled_back_automatically(canary_server):
    with httpx.Client(base_url=canary_server.url, timeout=30) as client:
        statuses = []
        for _ in range(300):
            statuses.append(_infer(client, "/v2/models/bad/infer").status_code)
            policy = client.get("/v2/repository/models/bad/traffic", headers=AUTH).json()
            if policy["canary_weight"] == 0:
                break
        assert policy["canary_weight"] == 0, "not rolled back"
        assert 500 in statuses
        after = [_infer(client, "/v2/models/bad/infer").status_code for _ in range(30)]
        assert after == [200] * 30
        report = client.get("/v2/models/bad/rollout").json()
        event = report["events"][-1]
        assert event["action"] == "auto-rollback" and "error rate" in event["reason"]
        assert "bitserve_rollout_rollbacks_total" in client.get("/metrics").text
    assert "auto-rollback" in canary_server.log.read_text()


# ------------------------------------------------------------------- shadow


SHADOWED = "[traffic]\nstable = 1\nshadow = 2\nshadow_percent = 100\n"
ALONE = "[traffic]\nstable = 1\n"
# the shadow is 5x slower than the primary; sleeps dominate CPU noise on a busy box
SLOW = {1: (0.02, False), 2: (0.1, False)}
PAIRS = 400


@pytest.fixture(scope="module")
def shadow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow") / "models"
    _versions(root, "slow", SHADOWED, SLOW)
    _versions(root, "broken", SHADOWED, {1: (0.0, False), 2: (0.0, True)})
    server = Server(root, "--admin-token", TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def alone_server(tmp_path_factory):
    """The same primary with no shadow: the baseline."""
    root = tmp_path_factory.mktemp("alone") / "models"
    _versions(root, "slow", ALONE, SLOW)
    server = Server(root)
    yield server
    server.stop()


def _timed(client: httpx.Client) -> float:
    started = time.perf_counter()
    answer = _infer(client, "/v2/models/slow/infer")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model_version"] == "1"
    return time.perf_counter() - started


def _pairs(shadowed: httpx.Client, alone: httpx.Client, n: int) -> tuple[list, list]:
    """n requests to each server, each pair sent at the same moment (which one leaves
    first alternates: the first one's timer also runs while the second is sent)."""
    on, off = [], []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for i in range(n):
            if i % 2:
                alone_time = pool.submit(_timed, alone)
                shadowed_time = pool.submit(_timed, shadowed)
            else:
                shadowed_time = pool.submit(_timed, shadowed)
                alone_time = pool.submit(_timed, alone)
            on.append(shadowed_time.result())
            off.append(alone_time.result())
    return on, off


def test_a_5x_slower_shadow_leaves_the_primary_p99_within_10_percent(shadow_server, alone_server):
    """Each request goes at the same moment to a server whose primary has the shadow and
    to one whose primary is alone, so a stall of the busy box hits both alike; 400 pairs,
    timed by the client. A stall that hits one process only still moves a p99 of 400
    by 10-20% when the 2-core box runs at load 5, so a miss is measured again, up to
    three times: a shadow that really slowed the primary would miss every time."""
    ratios = []
    with (
        httpx.Client(base_url=shadow_server.url, timeout=30) as shadowed,
        httpx.Client(base_url=alone_server.url, timeout=30) as alone,
    ):
        for _ in range(10):  # warm the connections and the versions
            _timed(shadowed), _timed(alone)
        for _ in range(3):
            on, off = _pairs(shadowed, alone, PAIRS)
            p99_on, p99_off = np.quantile(on, 0.99), np.quantile(off, 0.99)
            ratios.append(p99_on / p99_off)
            print(f"primary p99 with shadow {p99_on * 1000:.2f} ms, without "
                  f"{p99_off * 1000:.2f} ms, ratio {ratios[-1]:.3f}; p50 "
                  f"{np.median(on) * 1000:.2f} / {np.median(off) * 1000:.2f} ms")  # fmt: skip
            if ratios[-1] <= 1.10:
                break
        report = shadowed.get("/v2/models/slow/rollout").json()
        metrics = shadowed.get("/metrics").text
    assert ratios[-1] <= 1.10, ratios
    shadow = next(v for v in report["versions"] if v["version"] == "2")
    assert shadow["role"] == "shadow" and shadow["requests"] > 0
    assert shadow["latency_ms"]["p50"]["value"] >= 100
    assert report["shadow_comparison"]["compared"] > 0
    sent = _sample(metrics, 'bitserve_shadow_mirrors_sent_total{model="slow"}')
    dropped = _sample(metrics, 'bitserve_shadow_mirrors_dropped_total{model="slow"}')
    assert sent >= shadow["requests"] and sent + dropped == PAIRS * len(ratios) + 10


def test_a_failing_shadow_never_fails_the_primary(shadow_server):
    with httpx.Client(base_url=shadow_server.url, timeout=30) as client:
        answers = [_infer(client, "/v2/models/broken/infer") for _ in range(60)]
        assert [a.status_code for a in answers] == [200] * 60
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(lambda _: _infer(client, "/v2/models/broken/infer"), range(80)))
        assert [a.status_code for a in burst] == [200] * 80
        time.sleep(0.5)
        report = client.get("/v2/models/broken/rollout").json()
    comparison = report["shadow_comparison"]
    assert comparison["mirrored"] > 0 and comparison["shadow_errors"] == comparison["mirrored"]
    candidate = report["candidates"][0]
    assert candidate["role"] == "shadow" and candidate["recommendation"] == "roll back"


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name))
    return float(line.split()[-1])


def test_cli_report_set_and_rollback(canary_server):
    from click.testing import CliRunner

    from bitserve.rollout.command import rollout

    runner, url = CliRunner(), ["--url", canary_server.url]
    shown = runner.invoke(rollout, ["report", "bad", *url])
    assert shown.exit_code == 0, shown.output
    assert "canary version 2 vs stable 1" in shown.output
    assert "recommendation: ROLL BACK" in shown.output and "auto-rollback" in shown.output
    denied = runner.invoke(rollout, ["set", "bad", "--weight", "20", *url])
    assert denied.exit_code == 1 and "401" in denied.output
    token = ["--token", TOKEN]
    changed = runner.invoke(rollout, ["set", "bad", "--weight", "20", *url, *token])
    assert changed.exit_code == 0 and '"canary_weight": 20.0' in changed.output
    back = runner.invoke(rollout, ["rollback", "bad", *url, *token])
    assert back.exit_code == 0 and "all traffic on stable version 1" in back.output
    as_json = runner.invoke(rollout, ["report", "bad", "--json", *url])
    assert '"canary_weight": 0.0' in as_json.output
