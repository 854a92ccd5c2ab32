"""Data-parallel replicas on a local Ray cluster that the test starts: a model served by
2 replica actors behind `bitserve serve --ray ADDRESS`; one replica's process killed
under load loses no request that had not started, is replaced, and readiness says so.

One Ray cluster for the module (starting Ray on a busy 2-core box takes seconds)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.conftest import XY_CONFIG, Server, write_model

ray = pytest.importorskip("ray")

PID_MODEL = """
import os
import time
import numpy as np

class Model:
    def predict(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            raise ValueError("negative input")
        time.sleep(0.02)  # a batch takes a while, so a kill lands mid-batch too
        return {"y": x, "pid": np.full((len(x), 1), os.getpid(), dtype=np.int64)}
"""

REPLICATED = (
    XY_CONFIG
    + """
[[output]]
name = "pid"
datatype = "INT64"
dims = [1]
[dynamic_batching]
max_queue_delay_ms = 2
[instance_group]
count = 2
isolation = "ray"
num_cpus = 0.5
"""
)


SCALED = (
    REPLICATED.replace("count = 2", "count = 1")
    + """
[instance_group.autoscaling]
min_replicas = {low}
max_replicas = 2
target_ongoing_requests = 4
upscale_delay_s = 0.5
downscale_delay_s = 2
"""
)


def body(x: float) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [x]}]}


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray; the server joins it with --ray, the test kills its actors' processes."""
    # address="local": a new Ray, never one another test (or user) left running here
    context = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory) -> Server:
    root: Path = tmp_path_factory.mktemp("replicas") / "models"
    write_model(root, "pid", REPLICATED, PID_MODEL)
    write_model(root, "scaled", SCALED.format(low=1), PID_MODEL)
    write_model(root, "lazy", SCALED.format(low=0), PID_MODEL)
    server = Server(root, "--ray", cluster)
    yield server
    server.stop()


def infer(client: httpx.Client, url: str, x: float, model: str = "pid") -> httpx.Response:
    return client.post(f"{url}/v2/models/{model}/infer", json=body(x), timeout=30)


def pid_of(response: httpx.Response) -> int:
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    return int(outputs["pid"][0])


class Load:
    """`workers` threads sending requests until stopped; every answer is kept."""

    def __init__(self, url: str, workers: int = 6, model: str = "pid"):
        self.url, self.model = url, model
        self.answers: list[tuple[int, str, int | None]] = []  # status, error, pid
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _send(self) -> None:
        with httpx.Client() as client:
            while not self.stopping.is_set():
                answer = infer(client, self.url, 1.0, self.model)
                ok = answer.status_code == 200
                error = "" if ok else answer.json().get("error", "")
                self.answers.append((answer.status_code, error, pid_of(answer) if ok else None))

    def stop(self) -> list[tuple[int, str, int | None]]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)
        return self.answers


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v2/models/pid/stats", timeout=5).json()["model_stats"][0]


def test_requests_spread_over_both_replicas_in_batches(server):
    before = stats(server.url)
    load = Load(server.url, workers=12)
    time.sleep(2.0)
    answers = load.stop()
    after = stats(server.url)
    rows = after["inference_count"] - before["inference_count"]
    batches = after["execution_count"] - before["execution_count"]
    assert rows / batches > 1.5, (rows, batches)  # the batcher batches in front of them
    assert all(status == 200 for status, _, _ in answers)
    pids = Counter(pid for _, _, pid in answers)
    assert len(pids) == 2, pids  # both replicas took batches
    assert min(pids.values()) > 0.2 * len(answers), pids


def test_a_killed_replica_loses_no_request_that_had_not_started(server):
    import os
    import signal

    load = Load(server.url)
    time.sleep(1.5)
    before = {pid for _, _, pid in list(load.answers)}
    assert len(before) == 2, before  # both replicas busy
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    saw_degraded = False
    model_ready = []
    replaced_in = None
    while time.monotonic() - killed_at < 60:
        ready = httpx.get(f"{server.url}/v2/health/ready", timeout=5)
        model_ready.append(httpx.get(f"{server.url}/v2/models/pid/ready", timeout=5).status_code)
        if ready.status_code == 200 and "degraded" in ready.text:
            saw_degraded = True
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        healthy = 'bitserve_instances_healthy{model="pid",version="1"} 2.0' in metrics
        if saw_degraded and healthy and "degraded" not in ready.text:
            replaced_in = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    time.sleep(1.0)  # the replacement serves too
    answers = load.stop()
    assert replaced_in is not None, "the replica was not replaced within 60 s"
    assert saw_degraded, "readiness never said a replica was being replaced"
    assert set(model_ready) == {200}, "the model stayed ready on its healthy replica"
    failures = [(status, error) for status, error, _ in answers if status != 200]
    # Only the batch running on the killed replica may fail, with a 503 that says retry.
    assert all(status == 503 and "retry" in error for status, error in failures), failures
    assert len(failures) <= 8, failures  # at most one batch (max_batch_size 8)
    pids = {pid for _, _, pid in answers if pid is not None}
    assert victim not in {pid for _, _, pid in answers[-20:]}
    assert pids - before, "no answer came from the replacement replica"
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert (
        'bitserve_instance_restarts_total{model="pid",reason="died",version="1"} 1.0' in (metrics)
        or 'reason="died"' in metrics
    )
    assert server.alive()
    assert httpx.get(f"{server.url}/v2/health/live", timeout=5).status_code == 200


def test_a_model_error_on_a_replica_is_a_500_with_its_message(server):
    with httpx.Client() as client:
        failed = infer(client, server.url, -1.0)
        assert failed.status_code == 500 and "negative input" in failed.json()["error"]
        assert infer(client, server.url, 1.0).status_code == 200
    assert "degraded" not in httpx.get(f"{server.url}/v2/health/ready", timeout=5).text


def retried(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith('bitserve_requests_retried_total{model="pid"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_sent_to_a_replica_that_just_died_runs_on_the_other(server):
    """Killed while idle, before any ping noticed: the next batch goes to it, finds it
    dead before starting, and is put back in the queue for the healthy replica."""
    import os
    import signal

    with httpx.Client() as client:
        # An idle router sends a lone request to the replica that answered last.
        last = pid_of(infer(client, server.url, 1.0))
        assert pid_of(infer(client, server.url, 1.0)) == last
        before = retried(server.url)
        os.kill(last, signal.SIGKILL)
        answer = infer(client, server.url, 3.0)
    assert answer.status_code == 200, answer.text
    assert pid_of(answer) != last
    assert retried(server.url) == before + 1
    deadline = time.monotonic() + 60
    while "degraded" in httpx.get(f"{server.url}/v2/health/ready", timeout=5).text or (
        'bitserve_instances_healthy{model="pid",version="1"} 2.0'
        not in httpx.get(f"{server.url}/metrics", timeout=5).text
    ):
        assert time.monotonic() < deadline, "the replica was not replaced within 60 s"
        time.sleep(0.1)


def test_a_ray_model_without_the_ray_option_says_how_to_fix_it(tmp_path):
    write_model(tmp_path / "models", "pid", REPLICATED, PID_MODEL)
    server = Server(tmp_path / "models", wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = httpx.get(f"{server.url}/startupz", timeout=5)
            if answer.status_code == 500:
                break
            time.sleep(0.1)
        assert answer.status_code == 500 and "--ray ADDRESS" in answer.text, answer.text
    finally:
        server.stop()


@pytest.mark.slow
def test_with_every_replica_dead_the_model_is_not_ready_until_one_is_back(server):
    import os
    import signal

    load = Load(server.url)
    time.sleep(1.0)
    pids = {pid for _, _, pid in load.stop() if pid is not None}
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    statuses = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        statuses.append(httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code)
        if statuses[-1] == 200 and 503 in statuses:
            break
        time.sleep(0.05)
    assert 503 in statuses, "ready stayed 200 with no replica alive"
    assert statuses[-1] == 200, "no replica came back within 60 s"
    with httpx.Client() as client:
        answer = infer(client, server.url, 2.0)
    assert answer.status_code == 200 and pid_of(answer) not in pids


def healthy(url: str, model: str) -> float:
    prefix = f'bitserve_instances_healthy{{model="{model}",'
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {prefix}")


def wait_for(condition, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow  # about 6 s quiet, 11 s at load 24: starting a replica
def test_a_load_step_scales_a_batched_model_up_and_idle_scales_it_back(server):
    """autoscaling (min 1, max 2, target 4 ongoing): one client keeps one replica; 16
    concurrent clients scale it to 2, both serving; back to one client, the surplus
    replica is drained and removed; no request fails in all of it."""
    assert healthy(server.url, "scaled") == 1
    one = Load(server.url, workers=1, model="scaled")
    time.sleep(1.5)  # three times the upscale delay: one client is no reason to grow
    assert healthy(server.url, "scaled") == 1
    many = Load(server.url, workers=16, model="scaled")
    wait_for(lambda: healthy(server.url, "scaled") == 2, "16 clients did not add a replica")
    seen = len(many.answers)
    wait_for(lambda: len({p for _, _, p in many.answers[seen:]}) == 2, "one replica idle")
    answers = many.stop()
    wait_for(lambda: healthy(server.url, "scaled") == 1, "not back to one replica")
    answers += one.stop()
    assert answers and {status for status, _, _ in answers} == {200}, Counter(answers)


def test_min_zero_scales_a_batched_model_to_zero_and_a_request_starts_one(server):
    wait_for(lambda: healthy(server.url, "lazy") == 0, "never scaled to zero")
    assert httpx.get(f"{server.url}/v2/models/lazy/ready", timeout=5).status_code == 200
    with httpx.Client() as client:
        answer = infer(client, server.url, 2.0, "lazy")
    assert answer.status_code == 200, answer.text
    assert healthy(server.url, "lazy") == 1
