"""LLM replicas on a multi-node Ray cluster the test starts (`ray.cluster_utils.Cluster`,
3 nodes of 1 CPU): 2 whole-engine replicas of a tiny random-weight llama, one per node,
behind `bitserve serve --ray ADDRESS`; greedy completions equal one engine's, streams
come back token by token, a client that goes away aborts its request on the replica."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bitserve.llm import LLM, SamplingParams
from tests.conftest import Server
from tests.server.test_openai import build_llm

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

REPLICATED = """
backend = "llm"
[instance_group]
isolation = "ray"
count = 2
num_cpus = 1
[parameters]
max_model_len = 256
num_kv_blocks = 64
route_sessions = true
"""

PROMPTS = ["the quick brown fox", "a paged kv cache", "continuous batching lets", "héllo"]


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_replicas") / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(REPLICATED)
    return root


@pytest.fixture(scope="module")
def server(cluster, repo):
    s = Server(repo, "--ray", cluster.address)
    s.cluster = cluster
    yield s
    s.stop()


def metric(server, name, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def settled(server, name: str, **labels) -> float:
    """A counter the replicas report each second, once two reads agree."""
    last = None
    while True:
        now = metric(server, name, **labels)
        if now == last:
            return now
        last = now
        time.sleep(1.5)


def cluster_address(server) -> str:
    return server.cluster.address


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": "chat", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    answer = httpx.post(
        f"{url}/v1/completions", json={**body, "ignore_eos": True, **extra}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_two_replicas_on_two_nodes_answer_as_one_engine(server, repo):
    ray.init(address=cluster_address(server), log_to_driver=False)
    try:  # a replica takes its node's one CPU: two nodes are full
        free = ray._private.state.available_resources_per_node()
        assert sorted(r.get("CPU", 0) for r in free.values()) == [0, 0, 1], free
    finally:
        ray.shutdown()
    offline = LLM(repo / "chat" / "1", num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )
    for _ in range(2):  # each prompt twice: both replicas answer some of them
        for prompt, reference in zip(PROMPTS, offline, strict=True):
            got = complete(server.url, prompt)
            assert got["choices"][0]["text"] == reference.outputs[0].text
            assert got["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    assert metric(server, "bitserve_llm_generation_tokens_total", model="chat") >= 16 * 8


def test_v2_generate_infer_and_stream_reach_the_replicas(server, repo):
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    offline = LLM(repo / "chat" / "1", num_kv_blocks=64).generate(
        ["the quick"], SamplingParams(**params)
    )[0]
    doc = {"text_input": "the quick", "parameters": params}
    generated = httpx.post(server.url + "/v2/models/chat/generate", json=doc, timeout=60).json()
    assert generated["text_output"] == offline.outputs[0].text
    tensor = {"shape": [1], "datatype": "BYTES"}
    inputs = [
        {"name": "text_input", **tensor, "data": ["the quick"]},
        {"name": "sampling_parameters", **tensor, "data": [json.dumps(params)]},
    ]
    infer = httpx.post(server.url + "/v2/models/chat/infer", json={"inputs": inputs}, timeout=60)
    assert infer.json()["outputs"][0]["data"][0] == offline.outputs[0].text
    with httpx.stream(
        "POST", server.url + "/v2/models/chat/generate_stream", json=doc, timeout=60
    ) as r:
        pieces = [
            json.loads(line[6:])["text_output"]
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]
    assert len(pieces) > 1 and "".join(pieces) == offline.outputs[0].text


def test_stream_comes_token_by_token_and_disconnect_aborts(server):
    body = {
        "model": "chat",
        "prompt": "the quick",
        "max_tokens": 240,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    before = settled(server, "bitserve_llm_generation_tokens_total", model="chat")
    chunks = []
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if len(chunks) >= 6:
                break
    assert all(len(c["choices"]) == 1 for c in chunks)
    deadline = time.monotonic() + 30  # the replicas report each second
    while metric(server, "bitserve_llm_num_requests_running", model="chat") != 0:
        assert time.monotonic() < deadline, "the replica kept generating for a closed stream"
        time.sleep(0.2)
    assert metric(server, "bitserve_llm_kv_cache_usage_perc", model="chat") == 0
    generated = settled(server, "bitserve_llm_generation_tokens_total", model="chat") - before
    assert generated < 120, generated  # aborted well before its 240 tokens


def test_sticky_sessions_keep_a_user_or_a_session_header_on_one_replica(server):
    """route_sessions: the OpenAI SDK's `user` field, or an `x-session-id` header, keeps
    every request of that session on one replica; with neither, the same requests
    (prompts shorter than a KV block: no prefix to follow) spread over both."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

    def served() -> list[float]:
        return [
            metric(server, "bitserve_llm_replica_requests_total", model="chat", replica=r)
            for r in ("0", "1")
        ]

    def sticky() -> float:
        return metric(server, "bitserve_llm_route_decisions_total", model="chat", rule="sticky")

    for session in ({}, {"user": "alice"}, {"extra_headers": {"x-session-id": "bob"}}):
        before, stuck = served(), sticky()
        for prompt in PROMPTS * 2:
            client.completions.create(
                model="chat", prompt=prompt, max_tokens=2, temperature=0, **session
            )
        spread = sorted(a - b for a, b in zip(served(), before, strict=True))
        if session:
            assert spread == [0, 8], (session, spread)
            assert sticky() - stuck == 7  # the first request chose; the others followed
        else:
            assert spread[0] >= 2, spread  # the least-loaded rule evens out the counts
            assert sticky() == stuck


def test_the_llm_hpa_scales_on_metrics_this_server_exports(server):
    """deploy/kubernetes/llm: the HPA validates against Kubernetes' schemas, and each
    metric it and the adapter rules name is one an llm model's pod exports."""
    import yaml

    from tests.conftest import ROOT

    folder = ROOT / "deploy" / "kubernetes" / "llm"
    hpa = yaml.safe_load((folder / "hpa.yaml").read_text())
    rules = yaml.safe_load((folder / "prometheus-adapter-rules.yaml").read_text())
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    served = {r["name"]["as"] for r in yaml.safe_load(rules["data"]["config.yaml"])["rules"]}
    assert names == served
    exported = {
        family.name
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        if any(s.labels.get("model") == "chat" for s in family.samples)
    }
    assert names <= exported, names - exported
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in (hpa, rules):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
