"""The response cache: a repeated request answered without a batch (the model's own
statistics and the cache's Prometheus counters, through tritonclient over HTTP and
gRPC), its bytes within the bound under thousands of distinct requests, LRU order, and
an LLM's sampled answers never cached while greedy ones are."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton_http

from bitserve.config import ModelConfig
from bitserve.metrics import Metrics
from bitserve.repository.cache import ResponseCache
from tests.server.conftest import metric
from tests.server.test_ensemble import client

BOUND = 2048  # the conftest's `cached` model: max_bytes


def executions(server, model: str) -> int:
    _, c = client(server, "http")
    return int(c.get_inference_statistics(model)["model_stats"][0]["execution_count"])


def triple(server, protocol: str, x: float) -> float:
    module, c = client(server, protocol)
    given = module.InferInput("x", [1, 1], "FP32")
    given.set_data_from_numpy(np.array([[x]], dtype=np.float32))
    return float(c.infer("cached", [given]).as_numpy("y")[0, 0])


@pytest.mark.parametrize(("protocol", "x"), [("http", 0.25), ("grpc", 0.5)])
def test_the_second_identical_request_is_a_hit_and_takes_no_batch(pipeline_server, protocol, x):
    url = pipeline_server.url
    hits = metric(url, "bitserve_cache_hits_total", model="cached")
    assert triple(pipeline_server, protocol, x) == 3 * x
    ran = executions(pipeline_server, "cached")
    assert triple(pipeline_server, protocol, x) == 3 * x
    assert executions(pipeline_server, "cached") == ran
    assert metric(url, "bitserve_cache_hits_total", model="cached") == hits + 1


def test_the_cache_stays_within_its_bound_under_distinct_requests(pipeline_server):
    url = pipeline_server.url
    misses = metric(url, "bitserve_cache_misses_total", model="cached")
    for i in range(300):
        triple(pipeline_server, "http", 1000.0 + i)
        if i % 25 == 0:
            assert metric(url, "bitserve_cache_bytes", model="cached") <= BOUND
    assert metric(url, "bitserve_cache_bytes", model="cached") <= BOUND
    assert metric(url, "bitserve_cache_misses_total", model="cached") == misses + 300
    assert metric(url, "bitserve_cache_evictions_total", model="cached") > 0


def unit_cache(max_bytes: int) -> ResponseCache:
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": 8,
            "response_cache": {"enable": True, "max_bytes": max_bytes},
        }
    )
    return ResponseCache(config, 1, Metrics())


def test_ten_thousand_distinct_answers_never_exceed_the_bound():
    cache = unit_cache(64 * 1024)
    rng = np.random.default_rng(0)
    for i in range(10_000):
        x = np.array([[float(i)]], dtype=np.float32)
        key = cache.key({"x": x})
        assert cache.get(key) is None
        cache.put(key, {"y": rng.standard_normal((1, int(rng.integers(1, 64)))).astype(np.float32)})
        assert cache.bytes <= 64 * 1024
        assert cache.bytes == sum(size for _, size in cache.entries.values())
    assert 0 < len(cache.entries) < 10_000
    assert cache.evictions._value.get() == 10_000 - len(cache.entries)


def test_least_recently_used_goes_first_and_kept_answers_are_private_copies():
    cache = unit_cache(3 * (20 + 400))  # three answers of 100 FP32 and a 20-byte key
    keys = [cache.key({"x": np.array([[float(i)]], np.float32)}) for i in range(4)]
    batch = np.zeros((4, 100), np.float32)
    for key, row in zip(keys[:3], batch, strict=False):
        cache.put(key, {"y": row[None]})
    batch[:] = 7  # the batch the answers were cut from changes: the cache does not
    assert cache.get(keys[0])["y"].max() == 0  # now keys[1] is the least recent
    cache.put(keys[3], {"y": batch[3:]})
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    with pytest.raises(ValueError):
        cache.get(keys[0])["y"][0, 0] = 1.0  # read-only


def generate(server, params: dict | None) -> str:
    _, c = client(server, "http")
    given = [triton_http.InferInput("text_input", [1], "BYTES")]
    given[0].set_data_from_numpy(np.array([b"And the earth"], dtype=object))
    if params is not None:
        given.append(triton_http.InferInput("sampling_parameters", [1], "BYTES"))
        given[1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return c.infer("tinylm", given).as_numpy("text_output")[0].decode()


@pytest.mark.parametrize("params", [None, {"temperature": 1.0, "max_tokens": 8}])
def test_sampled_llm_answers_are_never_cached(pipeline_server, params):
    url = pipeline_server.url
    looked_up = metric(url, "bitserve_cache_hits_total", model="tinylm") + metric(
        url, "bitserve_cache_misses_total", model="tinylm"
    )
    queries = metric(url, "bitserve_llm_prefix_cache_queries_total", model="tinylm")
    generate(pipeline_server, params)
    middle = metric(url, "bitserve_llm_prefix_cache_queries_total", model="tinylm")
    generate(pipeline_server, params)
    assert queries < middle < metric(url, "bitserve_llm_prefix_cache_queries_total", model="tinylm")
    after = metric(url, "bitserve_cache_hits_total", model="tinylm") + metric(
        url, "bitserve_cache_misses_total", model="tinylm"
    )
    assert after == looked_up  # not even looked up


def test_greedy_llm_answers_are_cached(pipeline_server):
    url = pipeline_server.url
    params = {"temperature": 0, "max_tokens": 8}
    hits = metric(url, "bitserve_cache_hits_total", model="tinylm")
    first = generate(pipeline_server, params)
    queries = metric(url, "bitserve_llm_prefix_cache_queries_total", model="tinylm")
    assert generate(pipeline_server, params) == first
    assert metric(url, "bitserve_llm_prefix_cache_queries_total", model="tinylm") == queries
    assert metric(url, "bitserve_cache_hits_total", model="tinylm") == hits + 1


@pytest.mark.slow
def test_ten_thousand_distinct_requests_through_the_server_stay_within_the_bound(
    pipeline_server,
):
    import asyncio

    import tritonclient.http.aio as triton_aio

    url = pipeline_server.url
    misses = metric(url, "bitserve_cache_misses_total", model="cached")

    async def flood() -> None:
        async with triton_aio.InferenceServerClient(url.removeprefix("http://")) as c:

            async def one(i: int) -> None:
                given = triton_aio.InferInput("x", [1, 1], "FP32")
                given.set_data_from_numpy(np.array([[-1.0 - i]], dtype=np.float32))
                await c.infer("cached", [given])

            for start in range(0, 10_000, 500):
                await asyncio.gather(*(one(i) for i in range(start, start + 500)))
                assert metric(url, "bitserve_cache_bytes", model="cached") <= BOUND

    asyncio.run(flood())
    assert metric(url, "bitserve_cache_misses_total", model="cached") == misses + 10_000
