"""The detector through a real `bitserve serve`: tritonclient, both versions, bad input,
batching, and the int8 version in shadow with IoU-matched agreement."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from bitserve.vision import data
from tests.conftest import Server
from tests.rollout.conftest import mirrored_report

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(detector_repository):
    # A body limit above 100 MB, so the 10,000 x 10,000 image meets the model's own limit.
    s = Server(detector_repository, "--max-body-size", "128MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(server.url.removeprefix("http://"), concurrency=16)
    yield c
    c.close()


def _infer(client, image, version="", **extra):
    return _answer(client.infer("detector", _inputs(image, **extra), model_version=version))


def _inputs(image, **extra):
    inputs = [triton.InferInput("image", list(image.shape), "UINT8")]
    inputs[0].set_data_from_numpy(image, binary_data=True)
    for name, (value, datatype, dtype) in extra.items():
        tensor = triton.InferInput(name, [image.shape[0], 1], datatype)
        tensor.set_data_from_numpy(np.full((image.shape[0], 1), value, dtype))
        inputs.append(tensor)
    return inputs


def _answer(result):
    return {n: result.as_numpy(n) for n in ("boxes", "scores", "classes", "num_detections")}


def _found(answer, canvas, row=0):
    """How many true digits have a detection of their class at IoU >= 0.5."""
    n = int(answer["num_detections"][row, 0])
    boxes, classes = answer["boxes"][row, :n], answer["classes"][row, :n]
    hits = 0
    for (x, y, w, h), label in zip(canvas.boxes, canvas.labels, strict=True):
        truth = np.array([x, y, x + w, y + h])
        lo, hi = np.maximum(boxes[:, :2], truth[:2]), np.minimum(boxes[:, 2:], truth[2:])
        inter = np.clip(hi - lo, 0, None).prod(axis=1)
        union = (boxes[:, 2:] - boxes[:, :2]).prod(axis=1) + w * h - inter
        hits += bool(np.any((inter / union >= 0.5) & (classes == label)))
    return hits


def test_both_versions_find_the_digits_with_the_same_outputs(client):
    canvases = data.heldout(8)
    for version in ("1", "2"):
        found = total = 0
        for canvas in canvases:
            answer = _infer(client, canvas.image[None, ..., None], version)
            assert answer["boxes"].shape == (1, 20, 4) and answer["boxes"].dtype == np.float32
            assert answer["scores"].shape == answer["classes"].shape == (1, 20)
            assert answer["classes"].dtype == np.int32
            assert answer["num_detections"].shape == (1, 1)
            found += _found(answer, canvas)
            total += len(canvas.boxes)
        assert found >= 0.9 * total, f"version {version} found {found} of {total} digits"


def test_rgb_any_size_and_request_parameters(client):
    canvas = data.heldout(1)[0]
    rgb = np.repeat(np.kron(canvas.image, np.ones((2, 2), np.uint8))[None, ..., None], 3, axis=3)
    answer = _infer(client, rgb)
    assert _found(answer, canvas) == 0  # boxes are in the 256 px image's coordinates...
    answer["boxes"] = answer["boxes"] / 2
    assert _found(answer, canvas) == len(canvas.boxes)  # ...which halve to the canvas's
    capped = _infer(client, rgb, max_detections=(1, "INT32", np.int32))
    assert capped["boxes"].shape == (1, 1, 4) and capped["num_detections"][0, 0] == 1
    strict = _infer(client, rgb, score_threshold=(0.999, "FP32", np.float32))
    assert strict["num_detections"][0, 0] < answer["num_detections"][0, 0]


def _post(server, body: bytes, header_length: int | None = None) -> httpx.Response:
    headers = {"Inference-Header-Content-Length": str(header_length)} if header_length else {}
    return httpx.post(
        f"{server.url}/v2/models/detector/infer", content=body, headers=headers, timeout=60
    )


def _binary_request(shape, datatype="UINT8", payload: bytes | None = None, size=None):
    payload = bytes(int(np.prod(shape))) if payload is None else payload
    size = len(payload) if size is None else size
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": datatype,
                    "shape": list(shape),
                    "parameters": {"binary_data_size": size},
                }
            ]
        }
    )
    return header + payload, len(header)


@pytest.mark.parametrize(
    ("case", "request_args", "message"),
    [
        ("wrong dtype", ((1, 16, 16, 1), "FP32"), "input 'image': datatype 'FP32'"),
        ("zero-size", ((1, 0, 0, 1),), "input 'image': zero-size image"),
        ("huge", ((1, 10_000, 10_000, 1),), "input 'image': 10000x10000"),
        ("truncated bytes", ((1, 64, 64, 1), "UINT8", b"\x07" * 100, 4096), "input 'image'"),
        ("bytes of the wrong length", ((1, 64, 64, 1), "UINT8", b"\x07" * 100), "input 'image'"),
        ("a channel count", ((1, 16, 16, 4),), "input 'image': 4 channels"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, case, request_args, message):
    body, length = _binary_request(*request_args)
    answer = _post(server, body, length)
    assert answer.status_code == 400, (case, answer.text)
    assert message in answer.json()["error"], (case, answer.json())
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


def test_garbage_body_is_a_400_and_the_server_stays_live(server, client):
    assert _post(server, b"\xff\x00garbage").status_code == 400
    assert _post(server, b'{"inputs": [{"name": "image"', 10).status_code == 400
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    assert _infer(client, data.heldout(1)[0].image[None, ..., None])["boxes"].shape[0] == 1


def _stats(server, version: str) -> dict:
    stats = httpx.get(f"{server.url}/v2/models/detector/stats").json()["model_stats"]
    return next(s for s in stats if s["version"] == version)


def test_concurrent_requests_share_batches(server):
    """64 requests on 16 connections at once (the repo's raw asyncio client: tritonclient's
    gevent pool sends too slowly to ever fill a batch) share fewer executions."""
    before = _stats(server, "1")
    images = [c.image[None, ..., None] for c in data.heldout(64)]
    statuses = asyncio.run(_send_all(server.port, [_raw(image) for image in images], 16))
    assert statuses == [200] * 64
    after = _stats(server, "1")
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == 64 and executions < 48  # some batches held more than one request


async def _send_all(port: int, raws: list[bytes], concurrency: int) -> list[int]:
    from bitserve.loadtest.client import connect

    connections = [await connect("127.0.0.1", port) for _ in range(concurrency)]

    async def worker(index: int) -> list[int]:
        answers = [await connections[index].request(r) for r in raws[index::concurrency]]
        return [status for status, _ in answers]

    results = await asyncio.gather(*(worker(i) for i in range(concurrency)))
    for connection in connections:
        connection.close()
    return [status for statuses in results for status in statuses]


def _raw(image: np.ndarray) -> bytes:
    body, length = _binary_request(image.shape, payload=image.tobytes())
    head = (
        "POST /v2/models/detector/versions/1/infer HTTP/1.1\r\nHost: test\r\n"
        f"Inference-Header-Content-Length: {length}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def test_int8_shadow_reports_box_agreement_with_stable(server, client):
    for canvas in data.heldout(40):
        _infer(client, canvas.image[None, ..., None])
    with httpx.Client(base_url=server.url, timeout=30) as http:
        report = mirrored_report(http, "detector", 40, timeout=60, every=0.5)
    comparison = report["shadow_comparison"]
    assert comparison["mirrored"] >= 40 and comparison["shadow_errors"] == 0
    figures = comparison["outputs"]["boxes"]
    assert figures["box_agreement"]["count"] >= 40
    assert figures["box_agreement"]["mean"] >= 0.85  # int8 finds nearly the same boxes
    assert figures["mean_iou"]["mean"] >= 0.8
    assert set(comparison["outputs"]) == {"boxes"}  # scores/classes are part of the match
