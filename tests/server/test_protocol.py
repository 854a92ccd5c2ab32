"""The v2 protocol against a real server, driven by the official tritonclient and httpx."""

from __future__ import annotations

import json
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import Server, write_model

DATATYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": ml_dtypes.bfloat16,
    "BYTES": np.object_,
}

ECHO = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"]}
"""

ROWFN = """
import numpy as np

class Model:
    def predict(self, inputs):
        x = inputs["x"]
        # a per-row function: each row's answer depends on that row only
        return {"y": x * 2 + x.sum(axis=1, keepdims=True), "n": np.full((len(x), 1), len(x))}
"""

SLOW = """
import time

class Model:
    def predict(self, inputs):
        time.sleep(float(inputs["ms"].max()) / 1000)
        return {"ms": inputs["ms"]}
"""

RAGGED = """
import numpy as np

class Model:
    def predict(self, inputs):
        ids, mask = inputs["ids"], inputs["mask"]
        return {"total": (ids * mask).sum(axis=1, keepdims=True),
                "length": mask.sum(axis=1, keepdims=True)}
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol") / "models"
    for name in DATATYPES:
        write_model(
            root,
            f"echo_{name.lower()}",
            f"""
            backend = "python"
            max_batch_size = 8
            [[input]]
            name = "x"
            datatype = "{name}"
            dims = [3]
            [[output]]
            name = "y"
            datatype = "{name}"
            dims = [3]
            [dynamic_batching]
            """,
            ECHO,
        )
    write_model(
        root,
        "rowfn",
        """
        backend = "python"
        max_batch_size = 16
        [[input]]
        name = "x"
        datatype = "FP32"
        dims = [4]
        [[output]]
        name = "y"
        datatype = "FP32"
        dims = [4]
        [[output]]
        name = "n"
        datatype = "INT64"
        dims = [1]
        [dynamic_batching]
        max_queue_delay_ms = 5
        """,
        ROWFN,
    )
    write_model(
        root,
        "unit",
        """
        backend = "python"
        max_batch_size = 8
        [[input]]
        name = "x"
        datatype = "FP32"
        dims = [3]
        value_range = [0, 1]
        [[output]]
        name = "y"
        datatype = "FP32"
        dims = [3]
        """,
        ECHO,
    )
    write_model(
        root,
        "slow",
        """
        backend = "python"
        max_batch_size = 1
        [[input]]
        name = "ms"
        datatype = "INT32"
        dims = [1]
        [[output]]
        name = "ms"
        datatype = "INT32"
        dims = [1]
        [dynamic_batching]
        max_queue_size = 2
        """,
        SLOW,
    )
    write_model(
        root,
        "ragged",
        """
        backend = "python"
        max_batch_size = 8
        [[input]]
        name = "ids"
        datatype = "INT64"
        dims = [-1]
        ragged = true
        mask = "mask"
        [[output]]
        name = "total"
        datatype = "INT64"
        dims = [1]
        [[output]]
        name = "length"
        datatype = "INT64"
        dims = [1]
        [dynamic_batching]
        max_queue_delay_ms = 20
        """,
        RAGGED,
    )
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, "--max-body-size", "1MiB")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def sample(datatype: str, rows: int = 2) -> np.ndarray:
    if datatype == "BYTES":
        words = [f"w{i}-é".encode() for i in range(rows * 3)]
        return np.array(words, dtype=np.object_).reshape(rows, 3)
    if datatype == "BOOL":
        return (np.arange(rows * 3) % 2 == 0).reshape(rows, 3)
    return np.arange(1, rows * 3 + 1).reshape(rows, 3).astype(DATATYPES[datatype])


def test_server_metadata_and_health(client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "bitserve" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_and_config(client):
    meta = client.get_model_metadata("rowfn")
    assert meta["versions"] == ["1"] and meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.is_model_ready("rowfn") and client.is_model_ready("rowfn", "1")
    assert not client.is_model_ready("rowfn", "7") and not client.is_model_ready("nope")
    assert client.get_model_config("rowfn")["max_batch_size"] == 16


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BF16"])
@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips(client, datatype, binary):
    data = sample(datatype)
    given = triton.InferInput("x", list(data.shape), datatype)
    given.set_data_from_numpy(data, binary_data=binary)
    wanted = triton.InferRequestedOutput("y", binary_data=binary)
    result = client.infer(f"echo_{datatype.lower()}", [given], outputs=[wanted])
    out = result.as_numpy("y")
    assert out.shape == data.shape
    if datatype == "BYTES":
        assert [x if isinstance(x, bytes) else x.encode() for x in out.ravel()] == list(
            data.ravel()
        )
    else:
        np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("binary_out", [False, True])
@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_json_nan_and_infinities_as_triton_reads_and_writes_them(client, datatype, binary_out):
    """tritonclient.http writes such floats as NaN/Infinity/-Infinity (Python's json), and
    Triton reads and writes them so (rapidjson's kParseNanAndInfFlag, kWriteNanAndInfFlag);
    strict JSON has none, and orjson would write null."""
    data = np.array([[np.nan, np.inf, -np.inf], [1.5, -0.0, 2.0]], dtype=DATATYPES[datatype])
    given = triton.InferInput("x", list(data.shape), datatype)
    given.set_data_from_numpy(data, binary_data=False)
    wanted = triton.InferRequestedOutput("y", binary_data=binary_out)
    result = client.infer(f"echo_{datatype.lower()}", [given], outputs=[wanted])
    np.testing.assert_array_equal(result.as_numpy("y"), data)


@pytest.mark.parametrize("binary", [False, True])
def test_nan_is_outside_every_value_range(client, binary):
    data = np.array([[0.5, np.nan, 1.0]], dtype=np.float32)
    given = triton.InferInput("x", list(data.shape), "FP32")
    given.set_data_from_numpy(data, binary_data=binary)
    with pytest.raises(InferenceServerException, match=r"input 'x': values must be in \[0, 1\]"):
        client.infer("unit", [given])
    given.set_data_from_numpy(np.array([[0.5, 0.0, 1.0]], dtype=np.float32), binary_data=binary)
    assert client.infer("unit", [given]).as_numpy("y").tolist() == [[0.5, 0.0, 1.0]]


def test_bf16_binary_and_json(server):
    """tritonclient has no numpy BF16; speak the binary extension by hand."""
    data = np.array([[1.5, -2.0, 3.25]], dtype=ml_dtypes.bfloat16)
    raw = data.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 3],
                    "datatype": "BF16",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = httpx.post(
        server.url + "/v2/models/echo_bf16/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    json_length = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:json_length])
    assert doc["outputs"][0]["datatype"] == "BF16"
    assert np.frombuffer(r.content[json_length:], dtype=ml_dtypes.bfloat16).tolist() == [
        1.5,
        -2.0,
        3.25,
    ]
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "BF16", "data": [1.5, -2, 3]}]}
    r = httpx.post(server.url + "/v2/models/echo_bf16/infer", json=body)
    assert r.json()["outputs"][0]["data"] == [1.5, -2.0, 3.0]


def test_bytes_length_prefix_layout(server):
    """BYTES in the binary extension: 4-byte little-endian length, then the bytes."""
    items = [b"a", b"", b"\xff\x00z"]
    raw = b"".join(struct.pack("<I", len(b)) + b for b in items)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 3],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    r = httpx.post(
        server.url + "/v2/models/echo_bytes/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    assert r.content[int(r.headers["Inference-Header-Content-Length"]) :] == raw


def test_concurrent_requests_equal_running_alone(client, server):
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32)]
    requests += [
        rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32) for _ in range(63)
    ]

    def call(x):
        c = triton.InferenceServerClient(server.url.removeprefix("http://"))
        given = triton.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        result = c.infer("rowfn", [given])
        return result.as_numpy("y"), int(result.as_numpy("n")[0, 0])

    before = httpx.get(server.url + "/v2/models/rowfn/stats").json()["model_stats"][0]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, requests))
    after = httpx.get(server.url + "/v2/models/rowfn/stats").json()["model_stats"][0]
    for x, (y, _) in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(y, x * 2 + x.sum(axis=1, keepdims=True))
    assert max(n for _, n in answers) > 1, "concurrent requests were never batched"
    assert after["inference_count"] - before["inference_count"] == sum(len(x) for x in requests)
    assert after["execution_count"] - before["execution_count"] < len(requests)


def test_ragged_inputs_are_padded_with_a_mask(server):
    sequences = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]

    def call(ids):
        body = {
            "inputs": [{"name": "ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids}]
        }
        return httpx.post(server.url + "/v2/models/ragged/infer", json=body).json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(call, sequences))
    for ids, answer in zip(sequences, answers, strict=True):
        outputs = {o["name"]: o["data"] for o in answer["outputs"]}
        assert outputs == {"total": [sum(ids)], "length": [len(ids)]}


def test_gzip_request_body(server):
    import gzip

    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT32", "data": [1, 2, 3]}]}
    r = httpx.post(
        server.url + "/v2/models/echo_int32/infer",
        content=gzip.compress(json.dumps(body).encode()),
        headers={"Content-Encoding": "gzip"},
    )
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1, 2, 3]


# ------------------------------------------------------------------ bad input


GOOD = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


def _bad(field, value):
    body = json.loads(json.dumps(GOOD))
    body["inputs"][0][field] = value
    return body


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v2/models/nope/infer", GOOD, 404, ["unknown model", "nope"]),
        ("/v2/models/echo_fp32/versions/9/infer", GOOD, 404, ["unknown version", "9"]),
        ("/v2/models/echo_fp32/infer", _bad("name", "z"), 400, ["unknown input", "'z'"]),
        ("/v2/models/echo_fp32/infer", _bad("datatype", "FP64"), 400, ["datatype", "FP32"]),
        ("/v2/models/echo_fp32/infer", _bad("shape", [1, 4]), 400, ["shape", "[-1, 3]"]),
        ("/v2/models/echo_fp32/infer", _bad("shape", [9, 3]), 400, ["batch size 9"]),
        ("/v2/models/echo_fp32/infer", _bad("data", [1, 2]), 400, ["needs 3 elements"]),
        ("/v2/models/echo_fp32/infer", _bad("data", ["a", "b", "c"]), 400, ["'x'", "FP32"]),
        ("/v2/models/echo_fp32/infer", {"inputs": []}, 400, ["'inputs'"]),
        ("/v2/models/echo_fp32/infer", {"inputs": [{"x": 1}]}, 400, ["'name'"]),
        (
            "/v2/models/echo_fp32/infer",
            {"outputs": [{"name": "q"}], **GOOD},
            400,
            ["unknown output", "'q'"],
        ),
        ("/v2/models/echo_fp32/infer", {**GOOD, "parameters": {"priority": -1}}, 400, ["priority"]),
        (
            "/v2/models/ragged/infer",
            {
                "inputs": [
                    {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]},
                    {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]},
                ]
            },
            400,
            ["twice"],
        ),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server, path, body, status, words):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]
    for word in words:
        assert word in message
    assert server.alive()


TRUNCATED = (
    b'{"inputs":[{"name":"x","shape":[1,3],"datatype":"FP32",'
    b'"parameters":{"binary_data_size":12}}]}'
)


@pytest.mark.parametrize(
    ("content", "headers", "words"),
    [
        (b'{"inputs": [', {}, ["malformed JSON"]),
        (b"[1, 2]", {}, ["JSON object"]),
        (
            TRUNCATED + b"\x00" * 5,
            {"Inference-Header-Content-Length": str(len(TRUNCATED))},
            ["truncated", "12"],
        ),
        (b"{}", {"Inference-Header-Content-Length": "999"}, ["999"]),
        (b"{}", {"Content-Encoding": "gzip"}, ["gzip"]),
    ],
)
def test_malformed_bodies(server, content, headers, words):
    r = httpx.post(server.url + "/v2/models/echo_fp32/infer", content=content, headers=headers)
    assert r.status_code == 400, r.text
    for word in words:
        assert word in r.json()["error"]


def test_oversized_body_gets_413_and_server_keeps_serving(server, client):
    big = b'{"inputs": [' + b" " * (2 << 20) + b"]}"
    r = httpx.post(server.url + "/v2/models/echo_fp32/infer", content=big)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]
    # chunked, without a Content-Length
    r = httpx.post(
        server.url + "/v2/models/echo_fp32/infer", content=iter([big[: 1 << 20], big[1 << 20 :]])
    )
    assert r.status_code == 413
    assert client.is_server_live()
    r = httpx.post(server.url + "/v2/models/echo_fp32/infer", json=GOOD)
    assert r.status_code == 200


def test_unknown_route_is_a_json_404(server):
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_tritonclient_surfaces_errors(client):
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", [triton.InferInput("x", [1, 3], "FP32")])


# ----------------------------------------------------- overload and deadlines


def _slow_body(ms: int, timeout_us: int | None = None) -> dict:
    body = {"inputs": [{"name": "ms", "shape": [1, 1], "datatype": "INT32", "data": [ms]}]}
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return body


def _stats(server, model):
    return httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]


def test_full_queue_gets_429_with_retry_after(server):
    url = server.url + "/v2/models/slow/infer"
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(httpx.post, url, json=_slow_body(800), timeout=10)
        time.sleep(0.2)
        queued = [pool.submit(httpx.post, url, json=_slow_body(1), timeout=10) for _ in range(2)]
        time.sleep(0.2)
        rejected = httpx.post(url, json=_slow_body(1))
        assert rejected.status_code == 429
        assert int(rejected.headers["Retry-After"]) >= 1
        assert "queue is full" in rejected.json()["error"]
        assert running.result().status_code == 200
        assert [f.result().status_code for f in queued] == [200, 200]


def test_request_timing_out_in_queue_gets_504_and_never_runs(server):
    url = server.url + "/v2/models/slow/infer"
    before = _stats(server, "slow")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, url, json=_slow_body(600), timeout=10)
        time.sleep(0.2)
        late = httpx.post(url, json=_slow_body(1, timeout_us=100_000), timeout=10)
        assert running.result().status_code == 200
    assert late.status_code == 504 and "timed out" in late.json()["error"]
    after = _stats(server, "slow")
    assert after["rejected_timeout"] - before["rejected_timeout"] == 1
    assert after["inference_count"] - before["inference_count"] == 1


def test_client_disconnect_removes_queued_request(server):
    url = server.url + "/v2/models/slow/infer"
    before = _stats(server, "slow")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, url, json=_slow_body(800), timeout=10)
        time.sleep(0.2)
        body = json.dumps(_slow_body(1)).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(
                b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            time.sleep(0.2)
        assert running.result().status_code == 200
    time.sleep(0.1)
    after = _stats(server, "slow")
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["inference_count"] - before["inference_count"] == 1
