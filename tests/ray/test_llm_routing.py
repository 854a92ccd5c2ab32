"""Prefix affinity measured end to end on a 3-node Ray cluster the test starts: 200
chats over 8 long shared system prompts, sent in the same run to one replica, to 2
replicas behind the prefix-aware router and to 2 behind round-robin. Each replica's KV
pool holds about half of the system prompts, so only a router that keeps each prompt on
one replica keeps its cache paying. Hit rates are the engines' own prefix-cache
counters (vLLM's definition: prompt tokens served from the cache / looked up)."""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import Server
from tests.ray.test_llm_replicas import metric, settled
from tests.server.test_openai import build_llm

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = """
backend = "llm"
[instance_group]
isolation = "ray"
count = {count}
num_cpus = 0.5
[parameters]
max_model_len = 256
num_kv_blocks = 44
route_policy = "{policy}"
"""
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "paged",
    "kv",
    "cache",
    "block",
    "sequence",
    "batching",
]
MODELS = {"one": (1, "prefix"), "affinity": (2, "prefix"), "rr": (2, "round_robin")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    root = tmp_path_factory.mktemp("llm_routing") / "models"
    build_llm(root / "one" / "1")
    for name, (count, policy) in MODELS.items():
        if name != "one":
            shutil.copytree(root / "one" / "1", root / name / "1")
        (root / name / "config.toml").write_text(CONFIG.format(count=count, policy=policy))
    s = Server(root, "--ray", cluster.address)
    yield s
    s.stop()
    cluster.shutdown()


def chats(n: int) -> list[list[dict]]:
    rng = random.Random(0)
    systems = [f"rules {i}: " + " ".join(random.Random(i).choices(WORDS, k=70)) for i in range(8)]
    return [
        [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=4))},
        ]
        for _ in range(n)
    ]


def test_prefix_affinity_keeps_the_single_replica_hit_rate(server):
    def ask(job: tuple[str, list[dict]]) -> int:
        model, messages = job
        body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code

    base = {
        m: (
            settled(server, "bitserve_llm_prefix_cache_hits_total", model=m),
            settled(server, "bitserve_llm_prefix_cache_queries_total", model=m),
        )
        for m in MODELS
    }
    jobs = [(model, messages) for messages in chats(200) for model in MODELS]  # interleaved
    with ThreadPoolExecutor(12) as pool:
        assert set(pool.map(ask, jobs)) == {200}
    rate = {}
    for m in MODELS:
        hits = settled(server, "bitserve_llm_prefix_cache_hits_total", model=m) - base[m][0]
        queries = settled(server, "bitserve_llm_prefix_cache_queries_total", model=m) - base[m][1]
        rate[m] = hits / queries
    served = [
        metric(server, "bitserve_llm_replica_requests_total", model="affinity", replica=str(r))
        for r in range(2)
    ]
    print("prefix-cache hit rate", rate, "requests per replica (affinity)", served)
    assert rate["affinity"] >= 0.9 * rate["one"], rate
    assert rate["affinity"] > rate["rr"], rate
    assert max(served) <= 1.5 * min(served), served
    decided = {
        rule: metric(server, "bitserve_llm_route_decisions_total", model="affinity", rule=rule)
        for rule in ("prefix", "least_loaded", "overloaded")
    }
    assert sum(decided.values()) == 200 and decided["prefix"] > 0, decided
