"""The v2 protocol over gRPC (bitserve/server/grpc_server.py), through the official
clients: tritonclient.grpc (sync, aio and its stream), the grpc.health.v1 client, and
tritonclient's own generated messages for typed `contents`. Every default model answers
over gRPC what it answers over HTTP; an LLM's streamed tokens are its greedy answer; the
classification extension answers the same top k on both protocols."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from tests.conftest import ROOT, Server, free_port

LABELS = ["world", "sports", "business", "science"]
GREEDY = {"temperature": 0, "max_tokens": 16}
TOKEN = "grpc-test-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(default_repository, tmp_path_factory):
    """The default repository with labels for bow_classifier's four classes."""
    repo = tmp_path_factory.mktemp("grpc") / "models"
    shutil.copytree(default_repository, repo)
    config = repo / "bow_classifier" / "config.toml"
    config.write_text(
        config.read_text().replace("dims = [4]\n", 'dims = [4]\nlabels = "labels.txt"\n')
    )
    (repo / "bow_classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    port = free_port()
    server = Server(repo, "--grpc-port", str(port), "--admin-token", TOKEN)
    server.grpc = f"127.0.0.1:{port}"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return tg.InferenceServerClient(server.grpc)


@pytest.fixture(scope="module")
def http(server):
    return th.InferenceServerClient(server.url.removeprefix("http://"))


def inputs(module, model: str) -> list:
    """The same request for every default model, as `module`'s InferInputs."""
    rng = np.random.default_rng(3)
    arrays = {
        "mlp": {"x": rng.standard_normal((3, 512)).astype(np.float32)},
        "minilm": {
            "text": np.array([[b"gRPC carries raw bytes."], [b"HTTP carries JSON."]], dtype=object)
        },
        "bow_classifier": {"input_ids": np.array([[5, 17, 42, 7, 999]], dtype=np.int64)},
        "bow_tokenizer": {"text": np.array([[b"Tokens by hash."]], dtype=object)},
        "bow_text": {"text": np.array([[b"An ensemble of two steps."]], dtype=object)},
        "detector": {"image": rng.integers(0, 255, (1, 48, 64, 1), dtype=np.uint8)},
        "digits": {
            "label": np.array([[3]], dtype=np.int32),
            "steps": np.array([[2]], dtype=np.int32),
            "seed": np.array([[7]], dtype=np.int64),
        },
        "tinylm": {
            "text_input": np.array([b"In the beginning"], dtype=object),
            "sampling_parameters": np.array([json.dumps(GREEDY).encode()], dtype=object),
        },
    }[model]
    out = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else tg.np_to_triton_dtype(array.dtype)
        given = module.InferInput(name, list(array.shape), datatype)
        given.set_data_from_numpy(array)
        out.append(given)
    return out


DEFAULT_MODELS = ["mlp", "minilm", "bow_classifier", "detector", "digits", "tinylm"]
DEFAULT_MODELS += ["bow_tokenizer", "bow_text"]  # the ensemble and its first step


def outputs_of(result, metadata: dict) -> dict[str, np.ndarray]:
    return {o["name"]: result.as_numpy(o["name"]) for o in metadata["outputs"]}


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        if array.dtype.kind == "f":
            np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_the_default_repository_is_the_one_served(client, http):
    index = client.get_model_repository_index(headers=ADMIN, as_json=True)["models"]
    over_http = http.get_model_repository_index(headers=ADMIN)
    assert index == [{k: v for k, v in m.items() if v} for m in over_http]  # proto3 drops ""
    served = sorted(m["name"] for m in index)
    assert served == sorted(p.name for p in (ROOT / "models").iterdir() if p.is_dir())
    assert set(DEFAULT_MODELS) == set(served)


@pytest.mark.parametrize("model", DEFAULT_MODELS)
def test_every_default_model_answers_grpc_as_http(client, http, server, model):
    metadata = http.get_model_metadata(model)
    assert client.get_model_metadata(model, as_json=True)["outputs"] == [
        {**o, "shape": [str(d) for d in o["shape"]]} for o in metadata["outputs"]
    ]
    expected = outputs_of(http.infer(model, inputs(th, model)), metadata)
    assert_same(outputs_of(client.infer(model, inputs(tg, model)), metadata), expected)

    async def aio() -> dict:
        async with tga.InferenceServerClient(server.grpc) as c:
            return outputs_of(await c.infer(model, inputs(tg, model)), metadata)

    assert_same(asyncio.run(aio()), expected)


def test_health_metadata_config_and_stats(client, http, server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "bitserve" and "classification" in meta["extensions"]
    config = client.get_model_config("bow_classifier").config
    assert config.max_batch_size == 32 and config.input[0].allow_ragged_batch
    assert config.input[0].data_type == model_config_pb2.TYPE_INT64
    assert config.output[0].label_filename == "labels.txt"
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert (
        client.get_model_config("minilm").config.input[0].data_type == model_config_pb2.TYPE_STRING
    )
    client.infer("mlp", inputs(tg, "mlp"))
    grpc_stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    http_stats = http.get_inference_statistics("mlp")["model_stats"][0]
    assert int(grpc_stats["inference_count"]) == http_stats["inference_count"] > 0


def test_grpc_health_service_gates_like_ready(server):
    with grpc.insecure_channel(server.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService", "mlp", "tinylm"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="no_such_model"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_typed_contents_equal_raw_contents(client, server):
    """tritonclient always sends raw_input_contents; its generated messages send
    typed contents, the other half of the protocol."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    given = tg.InferInput("x", [2, 512], "FP32")
    given.set_data_from_numpy(x)
    raw = client.infer("mlp", [given]).as_numpy("y")
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 512])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(server.grpc) as channel:
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        assert answer.outputs[0].shape == [2, 512]
        typed = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(2, 512)
        np.testing.assert_allclose(typed, raw, rtol=1e-5, atol=1e-6)
        request = service_pb2.ModelInferRequest(model_name="bow_classifier", id="typed")
        tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 3])
        tensor.contents.int64_contents.extend([5, 17, 42])
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        assert answer.id == "typed" and answer.outputs[0].datatype == "FP32"


def test_streamed_tokens_are_the_greedy_answer(client, http):
    unary = client.infer("tinylm", inputs(tg, "tinylm")).as_numpy("text_output")[0].decode()
    over_http = http.infer("tinylm", inputs(th, "tinylm")).as_numpy("text_output")[0].decode()
    assert unary == over_http and unary
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            "tinylm", inputs(tg, "tinylm"), request_id="s1", enable_empty_final_response=True
        )
        pieces = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            assert response.id == "s1"
            if response.parameters["triton_final_response"].bool_param:
                assert not response.outputs
                break
            pieces.append(result.as_numpy("text_output")[0].decode())
        assert len(pieces) > 1 and "".join(pieces) == unary
        # a batched model in the same stream: one response, its outputs as over infer
        client.async_stream_infer("mlp", inputs(tg, "mlp"))
        result, error = responses.get(timeout=120)
        assert error is None
        np.testing.assert_allclose(
            result.as_numpy("y"), client.infer("mlp", inputs(tg, "mlp")).as_numpy("y"), rtol=1e-5
        )
        # an error in a stream is that request's; the stream goes on
        client.async_stream_infer("no_such_model", inputs(tg, "mlp"))
        result, error = responses.get(timeout=120)
        assert result is None and "no_such_model" in str(error)
        client.async_stream_infer("bow_classifier", inputs(tg, "bow_classifier"))
        assert responses.get(timeout=120)[1] is None
    finally:
        client.stop_stream()


def test_stream_false_gives_one_response(client):
    given = inputs(tg, "tinylm")
    given[1].set_data_from_numpy(
        np.array([json.dumps({**GREEDY, "stream": False}).encode()], dtype=object)
    )
    unary = client.infer("tinylm", inputs(tg, "tinylm")).as_numpy("text_output")[0]
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("tinylm", given)
        result, error = responses.get(timeout=120)
        assert error is None and result.as_numpy("text_output")[0] == unary
    finally:
        client.stop_stream()
    assert responses.empty()


def test_aio_stream(server, client):
    unary = client.infer("tinylm", inputs(tg, "tinylm")).as_numpy("text_output")[0].decode()

    async def run() -> str:
        async with tga.InferenceServerClient(server.grpc) as c:

            async def requests():
                yield {"model_name": "tinylm", "inputs": inputs(tg, "tinylm")}

            text = ""
            async for result, error in c.stream_infer(requests()):
                assert error is None
                text += result.as_numpy("text_output")[0].decode()
            return text  # the stream ends once the request ends

    assert asyncio.run(run()) == unary


def top_k(probs: np.ndarray, k: int) -> list[list[bytes]]:
    """The reference: Triton's "score:index:label", highest first, as printf's %f."""
    rows = []
    for row in probs:
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        rows.append([f"{row[i]:f}:{i}:{LABELS[i]}".encode() for i in order])
    return rows


@pytest.mark.parametrize("k", [1, 3, 4, 10])
def test_classification_on_http_and_grpc(client, http, k):
    ids = np.array([[5, 17, 42], [7, 8, 9]], dtype=np.int64)
    plain = tg.InferInput("input_ids", [2, 3], "INT64")
    plain.set_data_from_numpy(ids)
    probs = client.infer("bow_classifier", [plain]).as_numpy("probs")
    expected = np.array(top_k(probs, k), dtype=object)
    got = client.infer(
        "bow_classifier", [plain], outputs=[tg.InferRequestedOutput("probs", class_count=k)]
    ).as_numpy("probs")
    assert got.shape == (2, min(k, 4))
    np.testing.assert_array_equal(got, expected)
    for binary in (False, True):
        given = th.InferInput("input_ids", [2, 3], "INT64")
        given.set_data_from_numpy(ids, binary_data=binary)
        asked = th.InferRequestedOutput("probs", binary_data=binary, class_count=k)
        got = http.infer("bow_classifier", [given], outputs=[asked]).as_numpy("probs")
        np.testing.assert_array_equal(got.astype(bytes).astype(object), expected)


def test_classification_without_labels_and_bad_k(client, http, server):
    given = inputs(tg, "mlp")
    got = client.infer("mlp", given, outputs=[tg.InferRequestedOutput("y", class_count=2)])
    y = client.infer("mlp", given).as_numpy("y")
    best = np.argsort(-y, axis=1, kind="stable")[:, :2]
    expected = [[f"{y[r, i]:f}:{i}".encode() for i in row] for r, row in enumerate(best)]
    np.testing.assert_array_equal(got.as_numpy("y"), np.array(expected, dtype=object))
    import httpx

    body = {
        "inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}],
        "outputs": [{"name": "probs", "parameters": {"classification": 0}}],
    }
    answer = httpx.post(server.url + "/v2/models/bow_classifier/infer", json=body)
    assert answer.status_code == 400 and "classification" in answer.json()["error"]
    request = service_pb2.ModelInferRequest(model_name="bow_classifier")
    request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 2])
    request.raw_input_contents.append(np.array([1, 2], dtype="<i8").tobytes())
    request.outputs.add(name="probs").parameters["classification"].int64_param = -3
    with grpc.insecure_channel(server.grpc) as channel, pytest.raises(grpc.RpcError) as e:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "output 'probs'" in e.value.details() and "classification" in e.value.details()


def test_the_proto_is_tritonclients(tmp_path):
    """Every message, field, enum value and method of our .proto is the same (number,
    type, label, streaming) in the copy tritonclient ships; the committed stubs are
    what tools/grpc_proto.py generates from it."""
    from grpc_tools import protoc

    proto = ROOT / "bitserve" / "api" / "proto" / "grpc_service.proto"
    out = tmp_path / "set.pb"
    assert (
        protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", str(proto)]) == 0
    )
    ours = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    pool = service_pb2.DESCRIPTOR.pool

    def same(message: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        theirs = pool.FindMessageTypeByName(prefix + message.name)
        for field in message.field:
            twin = theirs.fields_by_name[field.name]
            assert (twin.number, twin.type, twin.is_repeated) == (
                field.number,
                field.type,
                field.label == field.LABEL_REPEATED,
            ), f"{theirs.full_name}.{field.name}"
        for nested in message.nested_type:
            same(nested, f"{prefix}{message.name}.")

    for message in ours.message_type:
        same(message, "inference.")
    for enum in ours.enum_type:
        theirs = pool.FindEnumTypeByName("inference." + enum.name)
        assert {v.name: v.number for v in enum.value} == {v.name: v.number for v in theirs.values}
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.service[0].method:
        twin = service.methods_by_name[method.name]
        assert twin.input_type.full_name == method.input_type.lstrip(".")
        assert twin.output_type.full_name == method.output_type.lstrip(".")
        assert (twin.client_streaming, twin.server_streaming) == (
            method.client_streaming,
            method.server_streaming,
        )
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "grpc_proto.py"), "--out", str(tmp_path)], check=True
    )
    generated = tmp_path / "bitserve" / "api" / "proto"
    for path in sorted(generated.iterdir()):
        committed = Path(ROOT / "bitserve" / "api" / "proto" / path.name)
        assert path.read_text() == committed.read_text(), f"{path.name}: run tools/grpc_proto.py"


@pytest.mark.parametrize(
    "first, second",
    [("tritonclient.grpc", "bitserve.server.app"), ("bitserve.server.app", "tritonclient.grpc")],
)
def test_our_stubs_and_tritonclients_load_in_one_process(first, second):
    """Both define `inference.*`; protobuf's default pool takes a name once, so ours
    live in a pool of their own and either import order works."""
    code = f"import {first}, {second}; from bitserve.api.proto import grpc_service_pb2 as pb; "
    code += "print(pb.ModelInferRequest(model_name='m').SerializeToString().hex())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        done.stdout.strip()
        == service_pb2.ModelInferRequest(model_name="m").SerializeToString().hex()
    )


def test_a_grpc_port_another_server_holds_fails_the_start(server, tmp_path):
    """grpcio shares a port by default (SO_REUSEPORT): a second server would silently take
    half of the first one's calls. bitserve turns that off, so it fails at start, as a
    taken HTTP port does."""
    repo = tmp_path / "models"
    repo.mkdir()
    port = server.grpc.rsplit(":", 1)[1]
    try:
        second = Server(repo, "--grpc-port", port)
    except RuntimeError as e:
        assert "exited" in str(e)
    else:
        second.stop()
        pytest.fail(f"a second server started on the gRPC port {port} the first one holds")
    assert tg.InferenceServerClient(server.grpc).is_server_live()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_grpc_helper_threads_do_not_preempt_the_loop(server, client):
    """grpcio's event-engine threads and its asyncio poller run SCHED_BATCH
    (grpc_server.yield_to_loop), so their wakeups never preempt the event loop; the loop
    and the model threads keep the default policy."""
    assert client.is_server_live()
    pid = server.process.pid
    deadline = time.monotonic() + 10  # the health loop applies it every 0.25 s
    while True:
        policies = {}
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                policies[tid] = (name, os.sched_getscheduler(tid))
        engine = [p for name, p in policies.values() if name == "event_engine"]
        if (engine and set(engine) == {os.SCHED_BATCH}) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert engine and set(engine) == {os.SCHED_BATCH}, policies
    others = [p for name, p in policies.values() if name != "event_engine"]
    assert os.SCHED_BATCH in others, policies  # the poller (threads it starts inherit it)
    assert policies[pid][1] == os.SCHED_OTHER  # the event loop, and what it starts


def test_concurrent_unary_calls_batch_together(server, http):
    """64 ModelInfer calls sent at once on one channel reach the batcher together
    (grpc_accept.accept_ahead), so the mlp runs them several rows a batch, where
    grpc.aio's own accept loop hands them over one per loop wakeup and each finds the
    model idle (1.2 rows a batch); every call still gets its own row's answer."""
    rows = np.random.default_rng(7).standard_normal((64, 1, 512)).astype(np.float32)

    def one(module, row):
        x = module.InferInput("x", [1, 512], "FP32")
        x.set_data_from_numpy(row)
        return [x]

    expected = [http.infer("mlp", one(th, row)).as_numpy("y") for row in rows]

    def counts() -> tuple[int, int]:
        stats = http.get_inference_statistics("mlp")["model_stats"][0]
        return stats["inference_count"], stats["execution_count"]

    async def burst() -> list[np.ndarray]:
        async with tga.InferenceServerClient(server.grpc) as c:
            await c.infer("mlp", one(tg, rows[0]))  # the channel is connected
            before = counts()
            results = await asyncio.gather(*(c.infer("mlp", one(tg, row)) for row in rows))
            after = counts()
        return [r.as_numpy("y") for r in results], before, after

    got, before, after = asyncio.run(burst())
    for answer, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(answer, want, rtol=1e-4, atol=1e-5)
    inferred, executed = after[0] - before[0], after[1] - before[1]
    assert inferred == 64
    assert inferred / executed >= 4, f"{inferred} rows in {executed} batches"
