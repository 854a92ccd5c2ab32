"""OpenTelemetry traces (bitserve/tracing.py) as a collector receives them: the test
starts a real OTLP/gRPC receiver (opentelemetry-proto's TraceService, in this process),
points `bitserve serve --otlp-traces-endpoint` at it, sends requests that carry a W3C
`traceparent`, and reads back the span tree of each: a v2 infer over HTTP and over gRPC
(tritonclient), and an OpenAI chat stream (the openai client)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from transformers import AutoModelForCausalLM

from tests.conftest import XY_CONFIG, Server, free_port, write_model
from tests.llm.conftest import build_tokenizer, llama_config

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
DOUBLE = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""
LLM_CONFIG = """
backend = "llm"
[parameters]
max_model_len = 256
num_kv_blocks = 64
max_num_seqs = 4
"""
SERVER_KIND = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # the proto's name
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, names: set[str], limit: float = 30.0) -> list:
        """The spans of `trace_id` once all of `names` came (the exporter batches)."""
        deadline = time.monotonic() + limit
        while True:
            with self.lock:
                found = [s for s in self.spans if s.trace_id.hex() == trace_id]
            if names <= {s.name for s in found} or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@pytest.fixture(scope="module")
def receiver():
    port = free_port()
    collector = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    collector.endpoint = f"http://127.0.0.1:{port}"
    yield collector
    server.stop(0)


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    repo = tmp_path_factory.mktemp("tracing") / "models"
    write_model(repo, "double", XY_CONFIG + "[dynamic_batching]\n", DOUBLE)
    folder = repo / "chat" / "1"
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (repo / "chat" / "config.toml").write_text(LLM_CONFIG)
    grpc_port = free_port()
    server = Server(
        repo,
        "--grpc-port",
        str(grpc_port),
        "--otlp-traces-endpoint",
        receiver.endpoint,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    server.grpc = f"127.0.0.1:{grpc_port}"
    yield server
    server.stop()


def caller() -> tuple[str, str, dict]:
    """A caller's trace and span ids, and the `traceparent` header that carries them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def by_name(spans: list) -> dict:
    named = {}
    for span in spans:
        assert span.name not in named, f"two spans named {span.name}"
        named[span.name] = span
    return named


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def assert_model_call(spans: dict, parent, model: str) -> None:
    """`model {name}` under `parent`, its queue then execute under it."""
    call = spans[f"model {model}"]
    assert call.parent_span_id == parent.span_id
    queue, execute = spans["queue"], spans["execute"]
    assert queue.parent_span_id == call.span_id and execute.parent_span_id == call.span_id
    assert call.start_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= execute.start_time_unix_nano
    assert execute.end_time_unix_nano <= call.end_time_unix_nano
    assert call.end_time_unix_nano <= parent.end_time_unix_nano
    assert attributes(execute)["bitserve.batch_size"] >= 1
    assert attributes(execute)["bitserve.rows"] == 2


X = np.array([[1.0], [2.5]], dtype=np.float32)


def test_a_v2_http_request_is_a_span_tree_under_the_callers_traceparent(server, receiver):
    trace_id, span_id, headers = caller()
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    given = th.InferInput("x", [2, 1], "FP32")
    given.set_data_from_numpy(X)
    result = client.infer("double", [given], headers=headers)
    np.testing.assert_array_equal(result.as_numpy("y"), X * 2)

    http_name = "POST /v2/models/double/infer"
    spans = by_name(receiver.trace(trace_id, {http_name, "model double", "queue", "execute"}))
    assert set(spans) == {http_name, "model double", "queue", "execute"}
    root = spans[http_name]
    assert root.parent_span_id.hex() == span_id and root.kind == SERVER_KIND
    assert attributes(root)["http.response.status_code"] == 200
    assert_model_call(spans, root, "double")


def test_a_v2_grpc_request_is_a_span_tree_under_the_callers_traceparent(server, receiver):
    trace_id, span_id, headers = caller()
    client = tg.InferenceServerClient(server.grpc)
    given = tg.InferInput("x", [2, 1], "FP32")
    given.set_data_from_numpy(X)
    result = client.infer("double", [given], headers=headers)
    np.testing.assert_array_equal(result.as_numpy("y"), X * 2)

    rpc = "inference.GRPCInferenceService/ModelInfer"
    spans = by_name(receiver.trace(trace_id, {rpc, "model double", "queue", "execute"}))
    assert set(spans) == {rpc, "model double", "queue", "execute"}
    root = spans[rpc]
    assert root.parent_span_id.hex() == span_id and root.kind == SERVER_KIND
    assert attributes(root)["rpc.system"] == "grpc"
    assert_model_call(spans, root, "double")


def test_an_openai_stream_is_a_span_tree_with_the_llm_phases(server, receiver):
    trace_id, span_id, headers = caller()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "the tree of spans"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]

    http_name = "POST /v1/chat/completions"
    names = {http_name, "llm chat", "queue", "prefill", "decode"}
    spans = by_name(receiver.trace(trace_id, names))
    assert set(spans) == names
    root, llm = spans[http_name], spans["llm chat"]
    assert root.parent_span_id.hex() == span_id and root.kind == SERVER_KIND
    assert llm.parent_span_id == root.span_id
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert {queue.parent_span_id, prefill.parent_span_id, decode.parent_span_id} == {llm.span_id}
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano + 1000  # one clock's rounding
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano + 1000
    assert decode.end_time_unix_nano <= root.end_time_unix_nano
    assert attributes(prefill)["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes(decode)["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attributes(llm)["gen_ai.usage.output_tokens"] == usage.completion_tokens


def test_a_request_without_traceparent_starts_its_own_trace(server, receiver):
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    given = th.InferInput("x", [2, 1], "FP32")
    given.set_data_from_numpy(X)
    request_id = secrets.token_hex(4)
    client.infer("double", [given], request_id=request_id)
    http_name = "POST /v2/models/double/infer"
    deadline = time.monotonic() + 30
    roots = []
    while not roots and time.monotonic() < deadline:
        with receiver.lock:
            roots = [s for s in receiver.spans if s.name == http_name and not s.parent_span_id]
        time.sleep(0.05)
    assert roots, "no root span for a request without traceparent"


def test_a_grpc_stream_is_one_span_over_its_requests(server, receiver):
    trace_id, span_id, headers = caller()
    client = tg.InferenceServerClient(server.grpc)
    answers = []
    done = threading.Event()

    def callback(result, error):
        answers.append(error or result.as_numpy("y"))
        if len(answers) == 2:
            done.set()

    client.start_stream(callback, headers=headers)
    for _ in range(2):
        given = tg.InferInput("x", [2, 1], "FP32")
        given.set_data_from_numpy(X)
        client.async_stream_infer("double", [given])
    assert done.wait(30)
    client.stop_stream()
    for answer in answers:
        np.testing.assert_array_equal(answer, X * 2)

    rpc = "inference.GRPCInferenceService/ModelStreamInfer"
    spans = receiver.trace(trace_id, {rpc, "model double"})
    root = next(s for s in spans if s.name == rpc)
    assert root.parent_span_id.hex() == span_id and root.kind == SERVER_KIND
    calls = [s for s in spans if s.name == "model double"]
    assert len(calls) == 2 and all(c.parent_span_id == root.span_id for c in calls)
