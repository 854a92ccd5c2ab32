"""No request can take the engine down (issue: strict validation, a supervised engine,
honest health). Each request that once killed tinylm's engine, or answered 500 for a
caller's mistake, gets a 4xx (or, for in-range numerical extremes, a completion) and the
engine keeps serving. A fault inside a step fails one request; a killed step loop turns
the model not ready at once, fails what was in flight with 503 + Retry-After (streams end
with an error event), and the model serves again after the supervisor's restart."""

from __future__ import annotations

import shutil
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, Server

KILL = [7, 7, 7, 7]  # prompts starting with these kill the step loop (the hook below)
BREAK = [8, 8, 8, 8]  # these fail inside the forward pass (an Exception: isolated)
SLOW = [9, 9, 9, 9]  # these make every step take 20 ms: still in flight when the loop dies
HOOK = f"""
import time

KILL, BREAK, SLOW = {KILL}, {BREAK}, {SLOW}

def hook(seqs):
    for seq in seqs:
        if seq.prompt_token_ids[:4] == KILL:
            raise SystemExit("killed by the test hook")
        if seq.prompt_token_ids[:4] == BREAK:
            raise RuntimeError("this request breaks the forward pass")
    if any(seq.prompt_token_ids[:4] == SLOW for seq in seqs):
        time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    from build_models import build

    root = tmp_path_factory.mktemp("robust")
    repo = root / "models"
    for name in ("tinylm", "bow_classifier"):
        shutil.copytree(ROOT / "models" / name, repo / name)
    build(repo, names=["bow_classifier"])
    config = repo / "tinylm" / "config.toml"
    # a pause before the restart keeps the not-ready window long enough to observe
    config.write_text(config.read_text() + "restart_backoff_s = 2.0\n")
    (root / "faults.py").write_text(HOOK)
    env = {"BITSERVE_LLM_FAULT_HOOK": "faults:hook", "PYTHONPATH": str(root)}
    server = Server(repo, env=env)
    yield server
    server.stop()


def post(server, path, body, timeout=60.0):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def completion(server, **fields):
    return post(server, "/v1/completions", {"model": "tinylm", "max_tokens": 4, **fields})


def serves(server) -> None:
    answer = completion(server, prompt="In the beginning", temperature=0)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop")


BAD_COMPLETIONS = [
    ({"stop_token_ids": [99_999_999], "min_tokens": 1}, "stop_token_ids"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_tokens": True}, "max_tokens"),
    ({"seed": 2**70}, "seed"),
    ({"top_p": 0}, "top_p"),
    ({"n": 10**9}, "n"),
    ({"stop": [1, 2]}, "stop"),
    ({"logprobs": 10**6}, "logprobs"),
    ({"prompt": [-1, 5]}, "prompt"),
]


@pytest.mark.parametrize("fields, param", BAD_COMPLETIONS)
def test_openai_mistakes_are_400_naming_the_field(server, fields, param):
    answer = completion(server, **{"prompt": "hi", **fields})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    serves(server)


@pytest.mark.parametrize("field", ["top_p", "temperature"])
def test_numerical_extremes_in_range_complete(server, field):
    answer = completion(server, prompt="hi", seed=1, **{field: 5e-324})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    serves(server)


BAD_GENERATE = [  # (parameters, what the message names)
    ({"stop": [1, 2]}, "stop"),
    ({"skip_special_tokens": {}}, "skip_special_tokens"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"seed": "x"}, "seed"),
    ({"temperature": 5e-324, "top_p": -1}, "top_p"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"unknown_field": 1}, "unknown_field"),
    ([1, 2], "parameters"),
]


@pytest.mark.parametrize("parameters, field", BAD_GENERATE)
def test_v2_generate_mistakes_are_400(server, parameters, field):
    for path in ("/v2/models/tinylm/generate", "/v2/models/tinylm/generate_stream"):
        answer = post(server, path, {"text_input": "hi", "parameters": parameters})
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["error"]
    serves(server)


def _llm_infer(sampling: str) -> dict:
    return {
        "inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": [sampling]},
        ]
    }


def test_v2_infer_mistakes_are_400(server):
    answer = post(server, "/v2/models/tinylm/infer", _llm_infer("{not json"))
    assert answer.status_code == 400 and "sampling_parameters" in answer.json()["error"]
    answer = post(server, "/v2/models/tinylm/infer", _llm_infer('{"top_k": "5"}'))
    assert answer.status_code == 400 and "top_k" in answer.json()["error"]
    ids = {"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [5, 100_000]}
    answer = post(server, "/v2/models/bow_classifier/infer", {"inputs": [ids]})
    assert answer.status_code == 400 and "input_ids" in answer.json()["error"]
    ids["data"] = [5, 999]
    assert post(server, "/v2/models/bow_classifier/infer", {"inputs": [ids]}).status_code == 200
    serves(server)


def test_a_fault_inside_a_step_fails_one_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [[20, 21, 22, 23], [*BREAK, 30, 31], [40, 41, 42]]
    alone = [
        client.completions.create(model="tinylm", prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in (prompts[0], prompts[2])
    ]
    results: dict[int, object] = {}

    def one(i):
        try:
            results[i] = client.completions.create(
                model="tinylm", prompt=prompts[i], max_tokens=8, temperature=0
            )
        except openai.APIStatusError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results[1], openai.InternalServerError)
    assert "breaks the forward pass" in str(results[1])
    assert [results[0].choices[0].text, results[2].choices[0].text] == alone
    metrics = _metrics(server)
    assert metrics["bitserve_llm_requests_failed"] >= 1
    assert metrics.get("bitserve_llm_engine_restarts", 0) == 0
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") == "tinylm":
                values[sample.name.removesuffix("_total")] = sample.value
    return values


def test_a_killed_engine_is_not_ready_then_serves_again(server):
    client = httpx.Client(base_url=server.url, timeout=60.0)
    long = {"model": "tinylm", "prompt": SLOW, "max_tokens": 200, "ignore_eos": True}
    stream_events: list[str] = []
    inflight: dict[str, httpx.Response] = {}
    generating = threading.Event()

    def stream():
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stream_events.append(line)
                    generating.set()

    def blocking():
        inflight["answer"] = client.post("/v1/completions", json=long)

    workers = [threading.Thread(target=stream), threading.Thread(target=blocking)]
    for w in workers:
        w.start()
    assert generating.wait(30)  # 200 steps of 20 ms: both are still generating
    time.sleep(0.2)
    killed = client.post("/v1/completions", json={"model": "tinylm", "prompt": KILL})
    died = time.monotonic()
    assert killed.status_code == 503 and killed.headers["Retry-After"]
    ready = client.get("/v2/health/ready")
    assert time.monotonic() - died < 1.0
    assert ready.status_code == 503 and "tinylm" in ready.json()["error"]
    live = client.get("/v2/health/live")
    assert "died" in live.text and "SystemExit" in live.text
    refused = client.post("/v1/completions", json=long)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    for w in workers:
        w.join(30)
        assert not w.is_alive()  # no request hangs
    assert inflight["answer"].status_code == 503 and inflight["answer"].headers["Retry-After"]
    assert '"error"' in stream_events[-2] and stream_events[-1] == "data: [DONE]"
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.1)
    assert client.get("/v2/health/live").status_code == 200
    serves(server)
    assert _metrics(server)["bitserve_llm_engine_restarts"] == 1
    kv = _metrics(server)["bitserve_llm_kv_cache_usage_perc"]
    assert kv == 0.0


def test_a_stream_on_a_restarting_engine_is_503_not_a_cut_body(server):
    client = httpx.Client(base_url=server.url, timeout=60.0)
    client.post("/v1/completions", json={"model": "tinylm", "prompt": KILL})
    body = {"text_input": "hi", "parameters": {"max_tokens": 4}}
    answer = client.post("/v2/models/tinylm/generate_stream", json=body)
    assert answer.status_code == 503 and answer.headers["Retry-After"]
    deadline = time.monotonic() + 30
    while client.get("/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    answer = client.post("/v2/models/tinylm/generate_stream", json=body)
    assert answer.status_code == 200 and answer.text.count("data: ") >= 1
