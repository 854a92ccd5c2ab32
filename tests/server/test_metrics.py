"""/metrics read with Prometheus' own parser: histograms move by exactly what was sent."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import XY_CONFIG, Server, write_model

RECORDER = """
import time

class Model:
    def setup(self, config):
        self.log = open(config.parameters["log"], "a", buffering=1)

    def predict(self, inputs):
        x = inputs["x"]
        self.log.write(f"{len(x)}\\n")   # the batch sizes the model really saw
        if (x > 100).any():
            time.sleep(0.5)
        return {"y": x}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    log = root / "batches.txt"
    write_model(
        root / "models",
        "rec",
        XY_CONFIG
        + f"""
        [dynamic_batching]
        max_queue_delay_ms = 5
        max_queue_size = 64
        [parameters]
        log = "{log}"
        """,
        RECORDER,
    )
    s = Server(root / "models", "--access-log", str(root / "access.jsonl"))
    s.batch_log = log
    s.access_log = root / "access.jsonl"
    yield s
    s.stop()


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, frozen labels): value} for the rec model."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model", "rec") == "rec":
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model": "rec", "version": "1", **labels}.items())))
    return metrics.get(key, 0.0)


def body(x: float, rows: int = 1) -> dict:
    return {"inputs": [{"name": "x", "shape": [rows, 1], "datatype": "FP32", "data": [x] * rows}]}


def test_histograms_and_counters_move_by_what_was_sent(server):
    before = scrape(server.url)
    sizes_before = server.batch_log.read_text().split() if server.batch_log.exists() else []
    requests = [1, 2, 3, 1, 1, 2] * 5  # rows per request
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda n: httpx.post(server.url + "/v2/models/rec/infer", json=body(1.0, n)),
                requests,
            )
        )
    assert [a.status_code for a in answers] == [200] * len(requests)
    after = scrape(server.url)
    n = len(requests)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}

    def d(name, **labels):
        key = (name, tuple(sorted({"model": "rec", "version": "1", **labels}.items())))
        return delta.get(key, 0.0)

    assert d("bitserve_request_duration_seconds_count") == n
    assert d("bitserve_request_duration_seconds_sum") > 0
    assert d("bitserve_queue_duration_seconds_count") == n
    assert d("bitserve_request_success_total") == n
    seen = [int(s) for s in server.batch_log.read_text().split()][len(sizes_before) :]
    assert d("bitserve_batch_size_count") == len(seen) == d("bitserve_execution_count_total")
    assert d("bitserve_batch_size_sum") == sum(seen) == sum(requests)
    assert d("bitserve_inference_count_total") == sum(requests)
    assert d("bitserve_compute_duration_seconds_count") == len(seen)
    # the average batch size Prometheus would compute is the one the model saw
    assert d("bitserve_batch_size_sum") / d("bitserve_batch_size_count") == pytest.approx(
        sum(seen) / len(seen)
    )
    bucket_4 = d("bitserve_batch_size_bucket", le="4.0")
    assert bucket_4 == sum(1 for s in seen if s <= 4)


def test_failures_are_counted_by_reason(server):
    before = scrape(server.url)
    bad = httpx.post(server.url + "/v2/models/rec/infer", json={"inputs": [{"name": "x"}]})
    assert bad.status_code == 400
    # a queued request whose client disconnects is cancelled and never executed
    sizes_before = len(server.batch_log.read_text().split())
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(
            httpx.post, server.url + "/v2/models/rec/infer", json=body(500.0), timeout=10
        )
        time.sleep(0.2)
        raw = json.dumps(body(7.0)).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v2/models/rec/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                + str(len(raw)).encode()
                + b"\r\n\r\n"
                + raw
            )
            time.sleep(0.1)
        assert busy.result().status_code == 200
    time.sleep(0.2)
    after = scrape(server.url)
    assert (
        value(after, "bitserve_request_failure_total", reason="invalid")
        - value(before, "bitserve_request_failure_total", reason="invalid")
        == 1
    )
    assert (
        value(after, "bitserve_request_failure_total", reason="cancelled")
        - value(before, "bitserve_request_failure_total", reason="cancelled")
        == 1
    )
    assert len(server.batch_log.read_text().split()) == sizes_before + 1  # only the busy one


def test_gauges_and_load_time(server):
    with ThreadPoolExecutor(3) as pool:
        busy = [
            pool.submit(
                httpx.post, server.url + "/v2/models/rec/infer", json=body(500.0), timeout=10
            )
            for _ in range(3)
        ]
        time.sleep(0.25)
        during = scrape(server.url)
        assert [f.result().status_code for f in busy] == [200] * 3
    # one batch runs (500 ms), the other requests wait for the instance
    assert value(during, "bitserve_inflight_requests") == 3
    assert value(during, "bitserve_queue_depth") >= 1
    after = scrape(server.url)
    assert value(after, "bitserve_inflight_requests") == 0
    assert value(after, "bitserve_queue_depth") == 0
    assert value(after, "bitserve_instances_healthy") == 1
    assert value(after, "bitserve_model_load_seconds") > 0
    assert ("bitserve_model_warmup_seconds", (("model", "rec"), ("version", "1"))) in after


def test_access_log_is_one_json_line_per_request(server):
    httpx.post(server.url + "/v2/models/rec/infer", json=body(2.0, 3))
    last = json.loads(server.access_log.read_text().splitlines()[-1])
    assert last["model"] == "rec" and last["status"] == 200 and last["rows"] == 3
    assert last["batch_size"] >= 3 and last["duration_ms"] > 0
    assert set(last) >= {"time", "version", "queue_ms", "compute_ms"}


def test_cold_start_breakdown_sums_to_the_total(server):
    phases = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "bitserve_startup_seconds":
                phases[sample.labels["phase"]] = sample.value
    assert set(phases) == {"import", "load", "warmup", "other", "total"}
    parts = phases["import"] + phases["load"] + phases["warmup"] + phases["other"]
    assert parts == pytest.approx(phases["total"], abs=1e-6)
    assert phases["import"] > 0 and phases["total"] < 120
    assert all(v >= 0 for v in phases.values())
    assert "after process start" in (server.log.read_text())
