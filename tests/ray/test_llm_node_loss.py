"""Node loss under load on a 3-node Ray cluster the test starts: the raylet of a node
holding an LLM replica is killed mid-stream. No request hangs, the streams it held end
with an error event (503, service_unavailable), readiness stays 200 on the other
replica, new requests succeed, and the lost replica is replaced on the node with room."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.conftest import Server
from tests.ray.test_llm_autoscaling import wait_for
from tests.ray.test_llm_replicas import REPLICATED, complete, metric
from tests.server.test_openai import build_llm

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow


def stream(url: str) -> tuple[int, str]:
    """A streamed completion: its status and how it ended (a finish reason or the
    error event's code)."""
    body = {"model": "chat", "prompt": "the quick", "max_tokens": 200, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    end = "cut"  # no finish reason, no error event: the stream just stopped
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                doc = json.loads(line[6:])
                if "error" in doc:
                    lost = "was lost mid-request" in doc["error"]["message"]
                    end = f"error {doc['error']['type']}" + (" (replica lost)" if lost else "")
                elif doc["choices"][0]["finish_reason"]:
                    end = doc["choices"][0]["finish_reason"]
        return r.status_code, end


def test_a_node_lost_mid_load(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    root = tmp_path / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(REPLICATED)
    server = Server(root, "--ray", cluster.address)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        free = ray._private.state.available_resources_per_node()
        ray.shutdown()
        victim = next(n for n in workers if free[n.node_id].get("CPU", 0) == 0)
        results: list[tuple[int, str]] = []
        ready: list[int] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                results.append(stream(server.url))

        def probe() -> None:
            while not stop.is_set():
                ready.append(httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code)

        threads = [threading.Thread(target=client) for _ in range(8)]
        threads.append(threading.Thread(target=probe))
        for t in threads:
            t.start()
        wait_for(lambda: len(results) >= 8, "no stream finished before the kill")
        cluster.remove_node(victim, allow_graceful=False)  # its raylet and workers die
        wait_for(lambda: any(end.startswith("error") for _, end in results), "no stream cut")
        wait_for(
            lambda: metric(server, "bitserve_llm_replicas_replaced_total") >= 1, "not replaced"
        )
        stop.set()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a request hung"
        ends = {end for _, end in results}
        assert ends <= {"length", "error service_unavailable (replica lost)"}, ends
        assert {status for status, _ in results} == {200}  # the headers went out before
        assert set(ready) == {200}
        for _ in range(4):
            assert complete(server.url, "the quick")["choices"][0]["finish_reason"] == "length"
        assert metric(server, "bitserve_llm_replica_healthy", model="chat") == 2
    finally:
        server.stop()
        cluster.shutdown()
