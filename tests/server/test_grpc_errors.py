"""Every error of the v2 gRPC service by its status code, as Triton answers them, through
tritonclient.grpc and tritonclient's own messages: INVALID_ARGUMENT naming the field,
NOT_FOUND, UNAVAILABLE (unloaded, draining), RESOURCE_EXHAUSTED (queue full, message
too big), DEADLINE_EXCEEDED (and the request never runs), CANCELLED (the request leaves
the queue), UNAUTHENTICATED/PERMISSION_DENIED for repository calls. A client killed
mid-stream frees its KV blocks. The server stays live through all of it.

`gate` is a python model that holds its one instance while a request with x = 1 runs
until the test opens the gate (a file), and records every x it runs: requests queued
behind it are deterministic, with no sleeps in the tests.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, XY_CONFIG, Server, free_port, write_model

TOKEN = "errors-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
GATE_CONFIG = (
    XY_CONFIG
    + """
[dynamic_batching]
max_queue_size = 1
"""
)
GATE_CODE = """
import pathlib
import time

HERE = pathlib.Path(__file__).parent


class Model:
    def predict(self, inputs):
        x = inputs["x"]
        with open(HERE / "ran.txt", "a") as f:
            f.write(" ".join(str(int(v)) for v in x.reshape(-1)) + "\\n")
        if (x == 1).any():
            (HERE / "started").touch()
            while not (HERE / "open").exists():
                time.sleep(0.01)
        return {"y": x * 2}
"""
# Steps of a prompt of 100+ tokens take 20 ms: a long generation is still running when
# the test kills its client.
HOOK = """
import time


def hook(seqs):
    if any(len(seq.prompt_token_ids) >= 100 for seq in seqs):
        time.sleep(0.02)
"""
LONG_PROMPT = "and " * 120


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc_errors")
    repo = root / "models"
    write_model(repo, "gate", GATE_CONFIG, GATE_CODE)
    write_model(repo, "spare", GATE_CONFIG, GATE_CODE)
    shutil.copytree(ROOT / "models" / "tinylm", repo / "tinylm")
    (root / "grpc_faults.py").write_text(HOOK)
    return repo


def start(repo, *args: str) -> Server:
    port = free_port()
    env = {"BITSERVE_LLM_FAULT_HOOK": "grpc_faults:hook", "PYTHONPATH": str(repo.parent)}
    server = Server(repo, "--grpc-port", str(port), *args, env=env)
    server.grpc = f"127.0.0.1:{port}"
    return server


@pytest.fixture(scope="module")
def server(repo):
    args = ("--admin-token", TOKEN, "--model-control", "explicit", "--load-model", "*")
    server = start(repo, *args, "--max-body-size", "1MiB")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return tg.InferenceServerClient(server.grpc)


@pytest.fixture
def gate(repo):
    """Closed: a request with x = 1 holds the instance until `gate.open()`."""
    folder = repo / "gate" / "1"
    for name in ("open", "started", "ran.txt"):
        (folder / name).unlink(missing_ok=True)

    class Gate:
        def wait_started(self) -> None:
            deadline = time.monotonic() + 60
            while not (folder / "started").exists():
                assert time.monotonic() < deadline, "the gate request never started"
                time.sleep(0.01)

        def open(self) -> None:
            (folder / "open").touch()

        def ran(self) -> list[int]:
            text = (folder / "ran.txt").read_text() if (folder / "ran.txt").exists() else ""
            return [int(v) for v in text.split()]

    yield Gate()
    (folder / "open").touch()


def x_input(value: float, rows: int = 1) -> list:
    given = tg.InferInput("x", [rows, 1], "FP32")
    given.set_data_from_numpy(np.full((rows, 1), value, dtype=np.float32))
    return [given]


def hold(client, gate) -> list:
    """Start the request that holds the gate model's instance; its result lands in the list."""
    done: list = []
    client.async_infer("gate", x_input(1), callback=lambda result, error: done.append(error))
    gate.wait_started()
    return done


def until(condition, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def stats(server, model: str = "gate") -> dict:
    return httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]


def call(server, request: service_pb2.ModelInferRequest, **kwargs) -> grpc.RpcError:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, **kwargs)
    return e.value


def request_x(shape: list[int], datatype: str = "FP32", model: str = "gate", **contents):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return request


def raw_request(shape, payload: bytes, name="x", datatype="FP32", model="gate"):
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(payload)
    return request


BAD_REQUESTS = [
    (request_x([1, 1], "FP64", fp64_contents=[1.0]), "datatype"),
    (request_x([1, 2], fp32_contents=[1.0, 2.0]), "shape"),
    (request_x([9, 1], fp32_contents=[1.0] * 9), "batch size 9"),
    (request_x([-1, 1], fp32_contents=[1.0]), "shape"),
    (request_x([1, 1], fp32_contents=[1.0, 2.0]), "contents.fp32_contents"),
    (request_x([1, 1], fp64_contents=[1.0]), "contents.fp32_contents"),
    (request_x([2**62, 2**62], fp32_contents=[1.0]), "shape"),
    (raw_request([1, 1], b"\x00" * 3), "needs 4 bytes"),
    (raw_request([1, 1], b"\x00" * 4, name="nope"), "unknown input 'nope'"),
    (service_pb2.ModelInferRequest(model_name="gate"), "'inputs'"),
    (request_x([1, 1], model="", fp32_contents=[1.0]), "'model_name'"),
]


@pytest.mark.parametrize(("request_", "field"), BAD_REQUESTS)
def test_invalid_argument_names_the_field(server, client, request_, field):
    error = call(server, request_)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details()
    assert client.is_server_live()


def test_more_invalid_arguments(server, client):
    both = request_x([1, 1], fp32_contents=[1.0])
    both.raw_input_contents.append(b"\x00" * 4)
    extra = raw_request([1, 1], b"\x00" * 4)
    extra.raw_input_contents.append(b"\x00" * 4)
    output = request_x([1, 1], fp32_contents=[1.0])
    output.outputs.add(name="z")
    priority = request_x([1, 1], fp32_contents=[1.0])
    priority.parameters["priority"].string_param = "high"
    for request, field in [
        (both, "not both"),
        (extra, "raw_input_contents"),
        (output, "unknown output 'z'"),
        (priority, "parameter 'priority'"),
    ]:
        error = call(server, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details()
    llm = service_pb2.ModelInferRequest(model_name="tinylm")
    llm.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"hi"
    )
    sampling = llm.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    sampling.contents.bytes_contents.append(json.dumps({"temperature": -1}).encode())
    error = call(server, llm)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.details()
    assert client.is_server_live()


def test_not_found(server, client):
    error = call(server, request_x([1, 1], model="no_such_model", fp32_contents=[1.0]))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no_such_model" in error.details()
    pinned = request_x([1, 1], fp32_contents=[1.0])
    pinned.model_version = "7"
    error = call(server, pinned)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "version '7'" in error.details()
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no_such_model")
    assert e.value.status() == "StatusCode.NOT_FOUND"


def test_message_too_large_is_resource_exhausted(server, client):
    error = call(server, raw_request([1, 1], b"\x00" * (2 << 20)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert client.is_server_live()


def test_queue_full_is_resource_exhausted_with_retry_after(server, client, gate):
    held = hold(client, gate)
    queued: list = []
    client.async_infer("gate", x_input(2), callback=lambda result, error: queued.append(error))
    until(lambda: stats(server)["queue_depth"] == 1)
    error = call(server, request_x([1, 1], fp32_contents=[3.0]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in error.details()
    assert dict(error.trailing_metadata())["retry-after"].isdigit()
    gate.open()
    until(lambda: held and queued)
    assert held == [None] and queued == [None]
    assert gate.ran() == [1, 2]


def test_a_deadline_shorter_than_the_queue_wait_never_runs(server, client, gate):
    held = hold(client, gate)
    with pytest.raises(InferenceServerException) as e:
        client.infer("gate", x_input(5), client_timeout=0.5)
    assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    until(lambda: stats(server)["queue_depth"] == 0)  # the batcher dropped it unrun
    assert client.is_server_live()
    gate.open()
    until(lambda: held)
    client.infer("gate", x_input(6))
    assert gate.ran() == [1, 6]


def test_a_cancelled_call_leaves_the_queue(server, client, gate):
    held = hold(client, gate)
    before = stats(server)["cancelled"]
    errors: list = []
    call = client.async_infer(
        "gate", x_input(7), callback=lambda result, error: errors.append(error)
    )
    until(lambda: stats(server)["queue_depth"] == 1)
    call.cancel()
    until(lambda: stats(server)["cancelled"] == before + 1)
    assert stats(server)["queue_depth"] == 0
    until(lambda: errors)
    assert "CANCELLED" in str(errors[0].status())
    gate.open()
    until(lambda: held)
    client.infer("gate", x_input(8))
    assert gate.ran() == [1, 8]
    assert client.is_server_live()


def test_a_stream_answers_each_request_when_done_and_a_cancelled_one_leaves_the_queue(
    server, client, gate
):
    """A stream's batched requests are answered by callback, not awaited in order: an
    error for a later request comes while an earlier one waits in the queue; closing
    the stream takes the waiting one off the queue, as a cancelled call's."""
    held = hold(client, gate)
    before = stats(server)["cancelled"]
    sent: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        while (request := sent.get()) is not None:
            yield request

    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(requests())
        queued = request_x([1, 1], fp32_contents=[9.0])
        queued.id = "queued"
        sent.put(queued)
        until(lambda: stats(server)["queue_depth"] == 1)
        later = request_x([1, 1], model="no_such_model", fp32_contents=[1.0])
        later.id = "later"
        sent.put(later)
        assert "no_such_model" in next(answers).error_message
        answers.cancel()
        until(lambda: stats(server)["cancelled"] == before + 1)
        assert stats(server)["queue_depth"] == 0
    gate.open()
    until(lambda: held)
    assert held == [None]
    # the stream's own answers: in order of completion, the final flag when asked
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        flagged = request_x([1, 1], fp32_contents=[4.0])
        flagged.id = "flagged"
        flagged.parameters["triton_enable_empty_final_response"].bool_param = True
        bad = request_x([1, 2], fp32_contents=[1.0, 2.0])
        answers = list(stub.ModelStreamInfer(iter([flagged, bad])))
    assert len(answers) == 2
    errors = [a.error_message for a in answers if a.error_message]
    assert len(errors) == 1 and "shape" in errors[0]
    (ok,) = [a.infer_response for a in answers if not a.error_message]
    assert ok.id == "flagged" and ok.parameters["triton_final_response"].bool_param
    assert np.frombuffer(ok.raw_output_contents[0], "<f4").tolist() == [8.0]  # y = 2x
    assert gate.ran() == [1, 4]
    assert client.is_server_live()


def test_repository_calls_need_the_token(server, client):
    with pytest.raises(InferenceServerException) as e:
        client.unload_model("spare")
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as e:
        client.get_model_repository_index(headers={"authorization": "Bearer wrong"})
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    client.unload_model("spare", headers=ADMIN)
    assert not client.is_model_ready("spare")
    error = call(server, request_x([1, 1], model="spare", fp32_contents=[1.0]))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "unloaded" in error.details()
    client.load_model("spare", headers=ADMIN)
    assert client.is_model_ready("spare")
    assert client.infer("spare", x_input(4)).as_numpy("y")[0, 0] == 8


def test_model_control_none_is_permission_denied(repo):
    server = start(repo, "--admin-token", TOKEN)
    try:
        client = tg.InferenceServerClient(server.grpc)
        with pytest.raises(InferenceServerException) as e:
            client.unload_model("spare", headers=ADMIN)
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "model control" in e.value.message()
    finally:
        server.stop()


def kv_usage(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "bitserve_llm_kv_cache_usage_perc":
                return sample.value
    raise AssertionError("no KV usage metric")


STREAMER = """
import json, queue, sys
import numpy as np
import tritonclient.grpc as tg

client = tg.InferenceServerClient(sys.argv[1])
responses = queue.Queue()
client.start_stream(callback=lambda result, error: responses.put((result, error)))
text = tg.InferInput("text_input", [1], "BYTES")
text.set_data_from_numpy(np.array([sys.argv[2].encode()], dtype=object))
params = tg.InferInput("sampling_parameters", [1], "BYTES")
doc = {"max_tokens": 120, "ignore_eos": True, "temperature": 0}
params.set_data_from_numpy(np.array([json.dumps(doc).encode()], dtype=object))
client.async_stream_infer("tinylm", [text, params])
result, error = responses.get(timeout=120)
assert error is None, error
print("generating", flush=True)
responses.get(timeout=600)
"""


def test_a_killed_streaming_client_frees_its_kv(server, client, tmp_path):
    assert kv_usage(server) == 0.0
    script = tmp_path / "streamer.py"
    script.write_text(STREAMER)
    streamer = subprocess.Popen(
        [sys.executable, str(script), server.grpc, LONG_PROMPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert streamer.stdout.readline().strip() == "generating"
        os.kill(streamer.pid, signal.SIGKILL)
        streamer.wait(30)
    finally:
        if streamer.poll() is None:
            streamer.kill()
    until(lambda: kv_usage(server) == 0.0)
    text = httpx.get(server.url + "/metrics").text
    running = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "bitserve_llm_num_requests_running"
    ]
    assert running == [0.0]
    assert client.is_server_live() and client.is_model_ready("tinylm")


def test_draining_is_unavailable_and_not_serving(repo):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = start(repo, "--drain-timeout", "60")
    folder = repo / "gate" / "1"
    for name in ("open", "started", "ran.txt"):
        (folder / name).unlink(missing_ok=True)
    try:
        client = tg.InferenceServerClient(server.grpc)
        held: list = []
        client.async_infer("gate", x_input(1), callback=lambda result, error: held.append(error))
        until(lambda: (folder / "started").exists())
        server.process.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(server.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            until(lambda: health.Check(check).status == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not client.is_server_ready()
        error = call(server, request_x([1, 1], fp32_contents=[2.0]))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "draining" in error.details()
        (folder / "open").touch()
        until(lambda: held)
        assert held == [None]  # the in-flight request finished before the exit
        assert server.process.wait(60) == 0
    finally:
        (folder / "open").touch()
        server.stop()
