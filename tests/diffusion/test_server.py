"""The digits model behind a real `bitserve serve` on a loopback port: tritonclient and
the openai SDK against it, bad input, disconnects, metrics."""

from __future__ import annotations

import base64
import io
import json
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from PIL import Image

from tests.conftest import Server
from tests.diffusion.conftest import DIGITS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("diffusion") / "models"
    (repo / "digits" / "1").mkdir(parents=True)
    shutil.copy(DIGITS / "config.toml", repo / "digits")
    shutil.copy(DIGITS / "1" / "model.safetensors", repo / "digits" / "1")
    s = Server(repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def v2_images(client, labels, seeds, scale=3.0, steps=None):
    def tensor(name, values, datatype, dtype):
        t = triton.InferInput(name, [len(values), 1], datatype)
        t.set_data_from_numpy(np.array(values, dtype=dtype).reshape(-1, 1))
        return t

    inputs = [tensor("label", labels, "INT32", np.int32), tensor("seed", seeds, "INT64", np.int64)]
    inputs.append(tensor("guidance_scale", [scale] * len(labels), "FP32", np.float32))
    if steps is not None:
        inputs.append(tensor("steps", [steps] * len(labels), "INT32", np.int32))
    return client.infer("digits", inputs).as_numpy("image")


def decode(item) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(item.b64_json))))


def test_tritonclient_and_openai_sdk_draw_the_same_digits(client, sdk):
    meta = client.get_model_metadata("digits")
    assert meta["platform"] == "bitserve_diffusion"
    assert meta["outputs"][0] == {"name": "image", "datatype": "UINT8", "shape": [-1, 16, 16]}
    images = v2_images(client, [7, 7], [5, 6])
    assert images.shape == (2, 16, 16) and images.dtype == np.uint8
    answer = sdk.images.generate(
        model="digits",
        prompt="seven",
        n=2,
        response_format="b64_json",
        extra_body={"seed": 5, "guidance_scale": 3.0},
    )
    got = np.stack([decode(item) for item in answer.data])
    assert [item.model_extra["seed"] for item in answer.data] == [5, 6]
    assert answer.data[0].revised_prompt == "7"
    # the same seeds through either protocol: the same image (fp32 tolerance: 1 level)
    assert np.abs(got.astype(int) - images.astype(int)).max() <= 1
    assert images[0].max() > 128 and (images[0] != images[1]).any()


def test_concurrent_requests_share_denoising_steps(client, server):
    before = _metric(server, "bitserve_diffusion_steps_total")
    url = server.url.removeprefix("http://")
    clients = [triton.InferenceServerClient(url) for _ in range(8)]  # one per thread
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(v2_images, c, [i], [i], 3.0, 20) for i, c in enumerate(clients)]
        outs = [f.result() for f in futures]
    steps = _metric(server, "bitserve_diffusion_steps_total") - before
    assert all(o.shape == (1, 16, 16) for o in outs)
    # 8 requests of 20 steps alone would take 160 steps; sharing steps takes far fewer
    assert steps < 8 * 20 * 0.75, steps
    text = httpx.get(server.url + "/metrics").text
    for name in ("rows_per_step_bucket", "queue_seconds_bucket", "steps_per_second"):
        assert f"bitserve_diffusion_{name}" in text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "eleven"}, "prompt"),
        ({"prompt": "7", "steps": 0}, "steps"),
        ({"prompt": "7", "steps": 1001}, "steps"),
        ({"prompt": "7", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "7", "n": 100000}, "n"),
        ({"prompt": "7", "response_format": "url"}, "response_format"),
        ({"prompt": "7", "seed": "x"}, "seed"),
    ],
)
def test_bad_image_requests_get_a_400_naming_the_field(server, body, field):
    answer = httpx.post(server.url + "/v1/images/generations", json={"model": "digits", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


def test_bad_v2_inputs_get_a_400_naming_the_field(client, server):
    for labels, steps, field in (([12], 30, "label"), ([3], 0, "steps"), ([3], 5000, "steps")):
        with pytest.raises(triton.InferenceServerException, match=f"'{field}'") as e:
            v2_images(client, labels, [1], 3.0, steps)
        assert e.value.status() == "400"
    with pytest.raises(triton.InferenceServerException, match="'guidance_scale'"):
        v2_images(client, [3], [1], -2.0)
    body = {"model": "nope", "prompt": "1"}
    answer = httpx.post(server.url + "/v1/images/generations", json=body)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


def test_sdk_raises_bad_request_for_an_unknown_digit(sdk):
    with pytest.raises(openai.BadRequestError, match="not a digit"):
        sdk.images.generate(model="digits", prompt="a cat")


def test_a_client_that_disconnects_frees_its_rows(server):
    body = b'{"model": "digits", "prompt": "3", "n": 4, "steps": 1000, "guidance_scale": 3}'
    _disconnect_while_running(server, "/v1/images/generations", body)


V2_BODY = json.dumps(
    {
        "inputs": [
            {"name": name, "datatype": kind, "shape": [4, 1], "data": [value] * 4}
            for name, kind, value in (("label", "INT32", 3), ("steps", "INT32", 1000))
        ]
    }
).encode()


def test_a_v2_client_that_disconnects_frees_its_running_rows(server):
    _disconnect_while_running(server, "/v2/models/digits/infer", V2_BODY)


def _disconnect_while_running(server, path: str, body: bytes) -> None:
    """Send a 4-image, 1000-step request, wait until its rows run, hang up: the rows
    must leave the step loop at the next step, as cancelled, and the server stay live."""
    cancelled = _metric(server, "bitserve_diffusion_cancelled_total")
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        _wait(lambda: _metric(server, "bitserve_diffusion_running_rows") == 4)
    # 1000 steps take seconds; rows that finished instead of leaving are not "cancelled"
    _wait(lambda: _metric(server, "bitserve_diffusion_running_rows") == 0, limit=10)
    assert _metric(server, "bitserve_diffusion_cancelled_total") - cancelled == 4
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'model="digits"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait(condition, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
