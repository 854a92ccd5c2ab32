"""Health as a traffic gate on a real server: loading, wedged and killed instances."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import XY_CONFIG, Server, write_model

SLOW_SETUP = """
import time
import numpy as np

class Model:
    def setup(self):
        time.sleep(2.0)

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""

TOOLS = """
import os
import time
import numpy as np

class Model:
    def predict(self, inputs):
        x = inputs["x"]
        if (x < 0).any():            # a negative input hangs this batch
            time.sleep(float(-x.min()))
        return {"y": x, "pid": np.full((len(x), 1), os.getpid(), dtype=np.int64)}
"""

TOOLS_CONFIG = (
    XY_CONFIG
    + """[[output]]
name = "pid"
datatype = "INT64"
dims = [1]
[dynamic_batching]
[instance_group]
isolation = "{isolation}"
execution_timeout_ms = 400
"""
)

ECHO_CONFIG = XY_CONFIG


def body(x: float) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [x]}]}


def status(url: str, path: str) -> int:
    return httpx.get(url + path, timeout=2).status_code


def wait_for(predicate, limit: float = 30.0) -> float:
    """Seconds until predicate() holds (fails the test after `limit`)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > limit:
            pytest.fail(f"condition not met within {limit} s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_not_ready_while_a_slow_model_loads_then_ready(tmp_path):
    write_model(tmp_path, "slow_setup", ECHO_CONFIG, SLOW_SETUP)
    server = Server(tmp_path, wait_ready=False)
    try:
        assert status(server.url, "/v2/health/live") == 200
        ready = httpx.get(server.url + "/v2/health/ready")
        assert ready.status_code == 503 and "loading" in ready.json()["error"]
        assert status(server.url, "/startupz") == 503
        assert status(server.url, "/v2/models/slow_setup/ready") == 503
        r = httpx.post(server.url + "/v2/models/slow_setup/infer", json=body(1))
        assert r.status_code == 503 and "not ready" in r.json()["error"]
        wait_for(lambda: status(server.url, "/readyz") == 200)
        assert status(server.url, "/startupz") == 200
        assert status(server.url, "/v2/models/slow_setup/ready") == 200
    finally:
        server.stop()


def test_startup_probe_tells_broken_from_loading(tmp_path):
    write_model(tmp_path, "broken", ECHO_CONFIG, "raise ImportError('no such thing')\n")
    server = Server(tmp_path, wait_ready=False)
    try:
        wait_for(lambda: status(server.url, "/startupz") != 503)
        r = httpx.get(server.url + "/startupz")
        assert r.status_code == 500 and "broken" in r.json()["error"]
        assert status(server.url, "/readyz") == 503
        assert status(server.url, "/livez") == 200
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("health") / "models"
    write_model(root, "threaded", TOOLS_CONFIG.format(isolation="thread"), TOOLS)
    write_model(root, "isolated", TOOLS_CONFIG.format(isolation="process"), TOOLS)
    write_model(
        root,
        "other",
        ECHO_CONFIG,
        "class Model:\n    def predict(self, inputs):\n        return {'y': inputs['x']}\n",
    )
    server = Server(root)
    yield server
    server.stop()


def restarts(url: str, model: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "bitserve_instance_restarts_total" and sample.labels == {
                "model": model,
                "version": "1",
                "reason": reason,
            }:
                return sample.value
    return 0.0


def test_wedged_instance_fails_its_requests_and_is_replaced(tools_server):
    """A thread instance restarts in milliseconds (so live is 503 only that long); what
    must hold is that the held request fails at once and a fresh instance serves."""
    url = tools_server.url
    before = restarts(url, "threaded", "wedged")
    started = time.monotonic()
    answer = httpx.post(url + "/v2/models/threaded/infer", json=body(-5), timeout=10)
    # past the 400 ms execution timeout the watchdog (every 250 ms) restarts it
    assert time.monotonic() - started < 2.0, "the held request must fail, not wait 5 s"
    assert answer.status_code == 500 and "wedged" in answer.json()["error"]
    assert restarts(url, "threaded", "wedged") == before + 1
    wait_for(lambda: status(url, "/v2/health/live") == 200, limit=10)
    wait_for(lambda: status(url, "/v2/health/ready") == 200, limit=10)
    assert httpx.post(url + "/v2/models/threaded/infer", json=body(2)).status_code == 200


def test_killed_instance_process_is_restarted(tools_server):
    url = tools_server.url
    first = httpx.post(url + "/v2/models/isolated/infer", json=body(1)).json()
    pid = next(o["data"][0] for o in first["outputs"] if o["name"] == "pid")
    assert pid != tools_server.process.pid
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url + "/v2/models/isolated/infer", json=body(-3), timeout=10)
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: status(url, "/v2/health/live") == 503, limit=2)
        assert time.monotonic() - killed_at < 1.0
        answer = held.result()
        # the instance died under the request: 503 and when to retry, not a 500
        assert answer.status_code == 503 and "died" in answer.json()["error"]
        assert answer.headers["retry-after"] == "1"
        assert status(url, "/v2/health/ready") == 503
    # other models keep serving while the instance restarts
    assert httpx.post(url + "/v2/models/other/infer", json=body(3)).status_code == 200
    wait_for(lambda: status(url, "/v2/health/ready") == 200, limit=30)
    again = httpx.post(url + "/v2/models/isolated/infer", json=body(1)).json()
    new_pid = next(o["data"][0] for o in again["outputs"] if o["name"] == "pid")
    assert new_pid != pid
    assert restarts(url, "isolated", "died") == 1
    assert tools_server.alive()


def test_lazy_load_is_ready_at_once_and_loads_on_first_request(tmp_path):
    write_model(tmp_path, "slow_setup", ECHO_CONFIG, SLOW_SETUP)
    server = Server(tmp_path, "--lazy-load")
    try:
        ready = httpx.get(server.url + "/v2/health/ready")
        assert ready.status_code == 200 and ready.json()["lazy_models"] == ["slow_setup"]
        assert status(server.url, "/v2/models/slow_setup/ready") == 503  # not loaded yet
        with ThreadPoolExecutor(3) as pool:  # concurrent first requests share one load
            started = time.monotonic()
            first = list(
                pool.map(
                    lambda _: httpx.post(
                        server.url + "/v2/models/slow_setup/infer", json=body(4), timeout=30
                    ),
                    range(3),
                )
            )
            cold = time.monotonic() - started
        assert [r.status_code for r in first] == [200, 200, 200]
        assert 2.0 <= cold < 6.0  # the 2 s setup, once
        started = time.monotonic()
        assert (
            httpx.post(server.url + "/v2/models/slow_setup/infer", json=body(4)).status_code == 200
        )
        assert time.monotonic() - started < 1.0
        assert httpx.get(server.url + "/v2/health/ready").content == b""
        assert status(server.url, "/v2/models/slow_setup/ready") == 200
    finally:
        server.stop()
