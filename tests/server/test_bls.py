"""BLS: python models that call served models (tests/server/conftest.py's bls_*),
answering through the official tritonclient (HTTP and gRPC) what calling the models
one by one answers; awaited calls running at once (they batch at the callee); an LLM's
stream equal to its own v2 answer, and one left early stopping its generation; the
callee's errors, a timeout and an unknown model coming back to the caller."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as triton_http

from tests.conftest import ROOT
from tests.server.conftest import metric, wait_for
from tests.server.test_ensemble import TEXTS, client, infer, text

LONG_PROMPT = "And God said, Let there be light: and there was light. And God saw the light."


def steps_one_by_one(server, protocol: str, t: str) -> np.ndarray:
    ids = infer(server, protocol, "bow_tokenizer", "text", text(t), "input_ids")
    return infer(server, protocol, "bow_classifier", "input_ids", ids, "probs")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["bls_text", "bls_async"])
def test_a_bls_model_answers_what_its_calls_answer(pipeline_server, protocol, model):
    for t in TEXTS:
        got = infer(pipeline_server, protocol, model, "text", text(t), "probs")
        np.testing.assert_array_equal(got, steps_one_by_one(pipeline_server, protocol, t))


def test_awaited_bls_calls_run_at_once_and_batch_at_the_callee(pipeline_server):
    """bls_async awaits one ensemble call per request of its batch together: had they
    run one after another, bow_tokenizer would only ever see batches of one."""
    url = pipeline_server.url
    before = metric(url, "bitserve_batch_size_count", model="bow_tokenizer")
    rows_before = metric(url, "bitserve_batch_size_sum", model="bow_tokenizer")
    callers_before = metric(url, "bitserve_batch_size_count", model="bls_async")

    def call(i: int) -> np.ndarray:
        return infer(pipeline_server, "http", "bls_async", "text", text(f"caller {i}"), "probs")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(call, range(32)))
    assert all(a.shape == (1, 4) for a in answers)
    callers = metric(url, "bitserve_batch_size_count", model="bls_async") - callers_before
    rows = metric(url, "bitserve_batch_size_sum", model="bow_tokenizer") - rows_before
    batches = metric(url, "bitserve_batch_size_count", model="bow_tokenizer") - before
    assert rows == 32
    assert callers < 32, "the 32 callers never shared a batch: nothing to await together"
    assert batches < 32


def stream_call(server, prompt: str, limit: int) -> tuple[str, int]:
    _, c = client(server, "http")
    given = [
        triton_http.InferInput("prompt", [1], "BYTES"),
        triton_http.InferInput("limit", [1], "INT64"),
    ]
    given[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    given[1].set_data_from_numpy(np.array([limit], dtype=np.int64))
    answer = c.infer("bls_stream", given, timeout=120)
    return answer.as_numpy("text")[0].decode(), int(answer.as_numpy("pieces")[0])


def test_a_bls_stream_from_the_llm_equals_its_own_answer(pipeline_server):
    streamed, pieces = stream_call(pipeline_server, "In the beginning", 10_000)
    _, c = client(pipeline_server, "http")
    given = [
        triton_http.InferInput("text_input", [1], "BYTES"),
        triton_http.InferInput("sampling_parameters", [1], "BYTES"),
    ]
    params = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    given[0].set_data_from_numpy(np.array([b"In the beginning"], dtype=object))
    given[1].set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    whole = c.infer("tinylm", given).as_numpy("text_output")[0].decode()
    assert pieces > 1
    assert streamed == whole


def test_a_bls_stream_left_early_stops_the_generation(pipeline_server):
    """The long prompt makes each of tinylm's steps 0.3 s (the conftest's engine hook):
    its 200 tokens would take a minute, so only an abort frees the engine in time."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(ROOT / "models" / "tinylm" / "1" / "tokenizer.json"))
    assert 20 <= len(tokenizer.encode(LONG_PROMPT).ids) <= 50  # slowed, and fits the context
    streamed, pieces = stream_call(pipeline_server, LONG_PROMPT, 3)
    assert pieces == 3 and streamed
    url = pipeline_server.url
    wait_for(lambda: metric(url, "bitserve_llm_num_requests_running", model="tinylm") == 0)


@pytest.mark.parametrize(
    ("target", "x", "timeout_us", "expected"),
    [
        ("double", 1.0, 0, "ok"),
        ("boom", -1.0, 0, "ExecutionError: model 'boom': RuntimeError: boom cannot take"),
        ("slow", 1.0, 100_000, "QueueTimeout: model 'slow': no answer in 100000 us"),
        ("ghost", 1.0, 0, "ModelNotFound: unknown model 'ghost'"),
    ],
)
def test_a_bls_call_brings_back_the_callees_error(pipeline_server, target, x, timeout_us, expected):
    _, c = client(pipeline_server, "http")
    given = [
        triton_http.InferInput("model", [1], "BYTES"),
        triton_http.InferInput("x", [1], "FP32"),
        triton_http.InferInput("timeout_us", [1], "INT64"),
    ]
    given[0].set_data_from_numpy(np.array([target.encode()], dtype=object))
    given[1].set_data_from_numpy(np.array([x], dtype=np.float32))
    given[2].set_data_from_numpy(np.array([timeout_us], dtype=np.int64))
    answer = c.infer("bls_errors", given).as_numpy("error")[0].decode()
    assert answer.startswith(expected), answer
