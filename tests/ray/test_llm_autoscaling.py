"""Autoscaling LLM replicas on a 3-node Ray cluster the test starts: a step from 1 to
32 concurrent streams scales 1 -> 2 replicas, idle scales back to 1, no stream is cut;
min_replicas = 0 scales to zero after idle and the next request starts one."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import Server
from tests.ray.test_llm_replicas import metric
from tests.server.test_openai import build_llm

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = """
backend = "llm"
[instance_group]
isolation = "ray"
count = 1
num_cpus = 0.5
[instance_group.autoscaling]
min_replicas = {low}
max_replicas = 2
target_ongoing_requests = 4
upscale_delay_s = 1
downscale_delay_s = 3
[parameters]
max_model_len = 256
num_kv_blocks = 128
max_num_seqs = 32
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    root = tmp_path_factory.mktemp("llm_autoscaling") / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(CONFIG.format(low=1))
    build_llm(root / "lazy" / "1")
    (root / "lazy" / "config.toml").write_text(CONFIG.format(low=0))
    s = Server(root, "--ray", cluster.address)
    yield s
    s.stop()
    cluster.shutdown()


def replicas(server, model: str) -> int:
    return int(metric(server, "bitserve_llm_replica_healthy", model=model))


def wait_for(condition, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def stream(url: str, model: str) -> tuple[int, str | None]:
    """One streamed completion: its status and the finish reason of its last chunk."""
    body = {"model": model, "prompt": "the quick", "max_tokens": 48, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    finish = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return r.status_code, finish


def test_load_step_scales_up_then_idle_scales_down_with_no_stream_cut(server):
    assert replicas(server, "chat") == 1
    results: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            results.append(stream(server.url, "chat"))

    threads = [threading.Thread(target=client) for _ in range(32)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: replicas(server, "chat") == 2, "no second replica under 32 streams")
        served = lambda r: metric(  # noqa: E731
            server, "bitserve_llm_replica_requests_total", model="chat", replica=str(r)
        )
        wait_for(lambda: served(1) > 0, "the new replica got no request")
    finally:
        stop.set()
        for t in threads:
            t.join()
    wait_for(lambda: replicas(server, "chat") == 1, "not back to one replica after idle")
    assert results and set(results) == {(200, "length")}, set(results)


def test_min_zero_scales_to_zero_and_the_next_request_starts_a_replica(server):
    wait_for(lambda: replicas(server, "lazy") == 0, "never scaled to zero")
    assert httpx.get(f"{server.url}/v2/models/lazy/ready").status_code == 200
    assert stream(server.url, "lazy") == (200, "length")
    assert replicas(server, "lazy") == 1
