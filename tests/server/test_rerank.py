"""Rerank, score and v2 infer over a random-weight BERT cross-encoder, on a real server,
against sentence-transformers' CrossEncoder on the same folder."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import schemathesis
import torch
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from sentence_transformers import CrossEncoder

from tests.backends.test_hf import DOCUMENTS, QUERY, build_cross_encoder
from tests.conftest import Server, write_model

torch.set_num_threads(1)

CONFIG = """
backend = "hf"
max_batch_size = 16
[[input]]
name = "query"
datatype = "BYTES"
dims = [1]
[[input]]
name = "document"
datatype = "BYTES"
dims = [1]
[[output]]
name = "score"
datatype = "FP32"
dims = [{labels}]
[dynamic_batching]
max_queue_delay_ms = {delay}
[parameters]
task = "cross-encoder"
{parameters}
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerank") / "models"
    xenc = write_model(
        root, "xenc", CONFIG.format(labels=1, delay=50, parameters="max_documents = 8")
    )
    build_cross_encoder(xenc / "1")
    strict = write_model(
        root,
        "strict",
        CONFIG.format(
            labels=1, delay="1\nmax_queue_size = 1", parameters="truncate = false\nmax_length = 32"
        ),
    )
    shutil.copytree(xenc / "1", strict / "1", dirs_exist_ok=True)
    nli = write_model(root, "nli", CONFIG.format(labels=3, delay=1, parameters=""))
    build_cross_encoder(nli / "1", num_labels=3, seed=1)
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(repo) -> CrossEncoder:
    return CrossEncoder(str(repo / "xenc" / "1"), device="cpu")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_rerank_scores_and_order_equal_cross_encoder(server, reference):
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    ranked = reference.rank(QUERY, DOCUMENTS, top_k=3)
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]
    body = {"model": "xenc", "query": QUERY, "documents": documents, "top_n": 3}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        answer = post(server, path, body | {"return_documents": True})
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["index"] for r in results] == [r["corpus_id"] for r in ranked]
        for r in results:
            assert abs(r["relevance_score"] - expected[r["index"]]) <= 1e-5
            assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    everything = post(server, "/v1/rerank", body | {"top_n": None}).json()
    scores = [r["relevance_score"] for r in everything["results"]]
    assert sorted(scores, reverse=True) == scores and len(scores) == len(DOCUMENTS)
    assert "document" not in everything["results"][0]  # return_documents defaults to false
    tokenizer = reference.tokenizer
    tokens = [min(len(tokenizer(QUERY, d)["input_ids"]), 512) for d in DOCUMENTS]
    assert everything["usage"]["total_tokens"] == sum(tokens)
    clamped = post(server, "/v1/rerank", body | {"top_n": 100}).json()  # past the documents
    assert len(clamped["results"]) == len(DOCUMENTS)


def test_cohere_clients_read_the_rankings(server, reference):
    """Cohere's own SDK, v1 and v2, as the client of /v1/rerank and /v2/rerank."""
    import cohere

    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    ranked = [r["corpus_id"] for r in reference.rank(QUERY, DOCUMENTS, top_k=2)]
    v1 = cohere.Client(api_key="none", base_url=server.url, timeout=60)
    got = v1.rerank(model="xenc", query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=True)
    assert [r.index for r in got.results] == ranked
    assert [r.document.text for r in got.results] == [DOCUMENTS[i] for i in ranked]
    v2 = cohere.ClientV2(api_key="none", base_url=server.url, timeout=60)
    got = v2.rerank(model="xenc", query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [r.index for r in got.results] == ranked
    for r in got.results:
        assert abs(r.relevance_score - expected[r.index]) <= 1e-5
    with pytest.raises(cohere.BadRequestError):
        v2.rerank(model="xenc", query=QUERY, documents=[])


def test_score_pairs_as_vllm_and_equal_cross_encoder(server, reference):
    queries = ["first query", "a second, different query", QUERY, "q", "the last"]
    cases = [
        ({"text_1": QUERY, "text_2": DOCUMENTS}, [(QUERY, d) for d in DOCUMENTS]),
        ({"text_1": [QUERY], "text_2": DOCUMENTS[:2]}, [(QUERY, d) for d in DOCUMENTS[:2]]),
        ({"text_1": queries, "text_2": DOCUMENTS}, list(zip(queries, DOCUMENTS, strict=True))),
        ({"text_1": QUERY, "text_2": DOCUMENTS[0]}, [(QUERY, DOCUMENTS[0])]),
    ]
    for path in ("/v1/score", "/score"):
        for body, pairs in cases:
            answer = post(server, path, {"model": "xenc", **body})
            assert answer.status_code == 200, answer.text
            data = answer.json()["data"]
            assert [d["index"] for d in data] == list(range(len(pairs)))
            got = np.array([d["score"] for d in data])
            np.testing.assert_allclose(got, reference.predict(pairs), atol=1e-5, rtol=0)


def test_v2_infer_takes_two_texts_and_gives_fp32_scores(server, repo, reference):
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    pairs = [(QUERY, d) for d in DOCUMENTS]

    def infer(model: str) -> np.ndarray:
        inputs = []
        for name, column in (("query", 0), ("document", 1)):
            data = np.array([[p[column].encode()] for p in pairs], dtype=object)
            tensor = triton.InferInput(name, list(data.shape), "BYTES")
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        out = client.infer(model, inputs).as_numpy("score")
        assert out.dtype == np.float32
        return out

    scores = infer("xenc")
    assert scores.shape == (len(pairs), 1)
    np.testing.assert_allclose(scores[:, 0], reference.predict(pairs), atol=1e-5, rtol=0)
    nli = CrossEncoder(str(repo / "nli" / "1"), device="cpu")  # 3 labels: identity
    np.testing.assert_allclose(infer("nli"), nli.predict(pairs), atol=1e-5, rtol=0)
    client.close()


def test_models_and_schema_list_the_cross_encoders(server):
    ids = {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert {"xenc", "strict", "nli"} <= ids
    document = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"):
        assert "post" in document["paths"][path]
    enum = document["components"]["schemas"]["RerankRequest"]["properties"]["model"]["enum"]
    assert enum == ["nli", "strict", "xenc"]


def batch_counters(server) -> tuple[float, float]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith("bitserve_batch_size_") and s.labels.get("model") == "xenc":
                found[s.name] = s.value
    return found.get("bitserve_batch_size_count", 0.0), found.get("bitserve_batch_size_sum", 0.0)


def test_concurrent_rerank_requests_share_batches(server, reference):
    """16 clients at once, 2 documents each, on a model that waits 50 ms for a batch:
    the pairs of different requests run together (fewer batches than requests)."""
    count, rows = batch_counters(server)
    docs = [[f"document {i} about batching", DOCUMENTS[i % 5]] for i in range(16)]

    def rerank(pair: list[str]) -> list[dict]:
        body = {"model": "xenc", "query": QUERY, "documents": pair}
        return post(server, "/v1/rerank", body).json()["results"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(rerank, docs))
    for pair, results in zip(docs, answers, strict=True):
        expected = reference.predict([(QUERY, d) for d in pair])
        for r in results:
            assert abs(r["relevance_score"] - expected[r["index"]]) <= 1e-5
    after_count, after_rows = batch_counters(server)
    assert after_rows - rows == 32
    assert after_count - count < 16  # batches: some held pairs of several requests


BAD = [
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, "model"),
    ("/v1/rerank", {"model": 3, "query": "q", "documents": ["d"]}, "model"),
    ("/v1/rerank", {"model": "nosuch", "query": "q", "documents": ["d"]}, "model"),
    ("/v1/rerank", {"model": "nli", "query": "q", "documents": ["d"]}, "model"),  # 3 labels
    ("/v1/rerank", {"model": "xenc", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "xenc", "query": ["q"], "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "xenc", "query": " ", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "xenc", "query": "q"}, "documents"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": "d"}, "documents"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d", ""]}, "documents.1"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d", 7]}, "documents.1"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": [{"txt": "d"}]}, "documents.0"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": [{"text": ""}]}, "documents.0"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d"] * 9}, "documents"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d"], "top_n": -5}, "top_n"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d"], "top_n": "2"}, "top_n"),
    ("/v1/rerank", {"model": "xenc", "query": "q", "documents": ["d"], "top_n": 1.5}, "top_n"),
    (
        "/v1/rerank",
        {"model": "xenc", "query": "q", "documents": ["d"], "return_documents": "yes"},
        "return_documents",
    ),
    ("/v1/rerank", {"model": "strict", "query": "q", "documents": ["d", "w " * 40]}, "documents.1"),
    ("/v1/score", {"model": "xenc", "text_2": "d"}, "text_1"),
    ("/v1/score", {"model": "xenc", "text_1": "q"}, "text_2"),
    ("/v1/score", {"model": "xenc", "text_1": [], "text_2": "d"}, "text_1"),
    ("/v1/score", {"model": "xenc", "text_1": "q", "text_2": []}, "text_2"),
    ("/v1/score", {"model": "xenc", "text_1": 1, "text_2": "d"}, "text_1"),
    ("/v1/score", {"model": "xenc", "text_1": "q", "text_2": [None]}, "text_2"),
    ("/v1/score", {"model": "xenc", "text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2"),
    ("/v1/score", {"model": "xenc", "text_1": "q", "text_2": ["c"] * 9}, "text_2"),
    ("/v1/score", {"model": "xenc", "text_1": "", "text_2": ["c"]}, "text_1"),
    ("/v1/score", {"model": "xenc", "text_1": ["a", ""], "text_2": ["c", "d"]}, "text_1.1"),
    ("/v1/score", {"model": "strict", "text_1": "q", "text_2": "w " * 40}, "text_2"),
    ("/v1/score", {"model": "strict", "text_1": "q", "text_2": ["a", "w " * 40]}, "text_2.1"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    answer = post(server, path, body)
    assert answer.status_code in (400, 404), answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_a_full_queue_refuses_the_request_and_keeps_none_of_its_pairs(server):
    """40 documents are three requests of 16 rows; a queue of one cannot hold them: 429,
    and what was queued is taken back, so the next request is served."""
    body = {"model": "strict", "query": "q", "documents": [f"d {i}" for i in range(40)]}
    full = post(server, "/v1/rerank", body)
    assert full.status_code == 429, full.text
    assert "Retry-After" in full.headers
    answer = post(server, "/v1/rerank", body | {"documents": ["d"]})
    assert answer.status_code == 200, answer.text
    assert "Traceback" not in server.log.read_text()


def test_v2_infer_refuses_empty_texts_and_truncates_long_ones(server):
    def body(document: str) -> dict:
        return {
            "inputs": [
                {"name": "query", "shape": [1, 1], "datatype": "BYTES", "data": ["q"]},
                {"name": "document", "shape": [1, 1], "datatype": "BYTES", "data": [document]},
            ]
        }

    empty = post(server, "/v2/models/xenc/infer", body(""))
    assert empty.status_code == 400 and "'document'" in empty.json()["error"]
    long = post(server, "/v2/models/strict/infer", body("w " * 40))  # v2 truncates at 32
    assert long.status_code == 200, long.text


def test_fuzzed_rerank_and_score_never_fail_the_server(server):
    """The published schema of rerank and score, fuzzed (valid and invalid bodies): no
    answer is a 5xx and the server stays live and ready."""
    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json())
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path in ("/v1/rerank", "/v1/score")]
    assert len(operations) == 2
    failures: list[str] = []
    started = time.monotonic()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(server.url, operation, mode, failures, started)
    assert not failures, "\n".join(failures[:5])
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200 and server.alive()
    assert "Traceback" not in server.log.read_text()  # no bug answered as a 4xx either


def _fuzz(url, operation, mode, failures, started) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case) -> None:
        if time.monotonic() - started > 60:  # a bound on the test's time, not a check
            return
        answer = case.call(base_url=url, timeout=60)
        if answer.status_code >= 500:
            failures.append(f"{operation.label} {mode.value}: {answer.text[:200]}")

    run()
