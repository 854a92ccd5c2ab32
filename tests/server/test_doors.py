"""One front door for every protocol: a sampling value out of range gets the same 400
message, naming the field, through the OpenAI API, v2 generate, v2 infer, gRPC
(tritonclient) and a batch file, since every door builds SamplingParams one way
(backends.llm.sampling) and the one check is SamplingParams' own. The ranges are
OpenAI's where OpenAI sets them (temperature 0..2); the extensions beyond them
(top_k, min_p, repetition_penalty, logprobs up to 20) are accepted on every door.

One server (HTTP and gRPC) and one batch run serve every case.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from bitserve.llm.sampling_params import SamplingError, SamplingParams
from tests.conftest import Server, free_port
from tests.offline.conftest import openai_line, read_output, run_batch
from tests.server.test_openai import build_llm

CONFIG = 'backend = "llm"\n[parameters]\nmax_model_len = 128\nnum_kv_blocks = 64\n'
OUT_OF_RANGE = [  # (field, value): each past its limit
    ("max_tokens", 0),
    ("temperature", 2.5),  # OpenAI's bound, on every door
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("min_tokens", -1),
    ("logprobs", 21),
    ("seed", 2**63),
]
EXTENSIONS = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "logprobs": 20}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("doors") / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repo):
    port = free_port()
    server = Server(repo, "--grpc-port", str(port))
    server.grpc = f"127.0.0.1:{port}"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def batch(repo, tmp_path_factory):
    """Every case as one batch line (custom_id = the field): its output line by field."""
    folder = tmp_path_factory.mktemp("doors-batch")
    lines = [
        openai_line(field, "/v1/completions", {"model": "chat", "prompt": "hi", field: value})
        for field, value in OUT_OF_RANGE
    ]
    lines.append(openai_line("n", "/v1/completions", {"model": "chat", "prompt": "hi", "n": 0}))
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    run_batch(repo, folder / "in.jsonl", folder / "out.jsonl")
    return {doc["custom_id"]: doc for doc in read_output(folder / "out.jsonl")}


def expected(field: str, value) -> str:
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{field: value})
    return str(caught.value)


def openai_door(server, field, value) -> str:
    body = {"model": "chat", "prompt": "hi", field: value}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    return error["message"]


def generate_door(server, field, value) -> str:
    body = {"text_input": "hi", "parameters": {field: value}}
    answer = httpx.post(server.url + "/v2/models/chat/generate", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


def _tensors(field, value) -> list[dict]:
    sampling = json.dumps({field: value})
    return [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]},
        {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": [sampling]},
    ]


def infer_door(server, field, value) -> str:
    body = {"inputs": _tensors(field, value)}
    answer = httpx.post(server.url + "/v2/models/chat/infer", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


def grpc_door(server, field, value) -> str:
    inputs = []
    for tensor in _tensors(field, value):
        given = tg.InferInput(tensor["name"], [1], "BYTES")
        given.set_data_from_numpy(np.array([tensor["data"][0].encode()], dtype=object))
        inputs.append(given)
    client = tg.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("chat", inputs)
    client.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    return caught.value.message()


@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_one_message_naming_the_field_from_every_door(server, batch, field, value):
    message = expected(field, value)
    assert message.startswith(f"{field}: ")
    assert openai_door(server, field, value) == message
    assert generate_door(server, field, value) == message
    assert infer_door(server, field, value) == message
    assert grpc_door(server, field, value) == message
    line = batch[field]
    assert line["error"]["message"] == message
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["param"] == field


def test_n_is_openai_only_and_checked_alike_online_and_in_batch(server, batch):
    body = {"model": "chat", "prompt": "hi", "n": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    assert batch["n"]["error"]["message"] == answer.json()["error"]["message"]
    # v2 doors take no n: it is refused by name, not ignored
    answer = httpx.post(
        server.url + "/v2/models/chat/generate",
        json={"text_input": "hi", "parameters": {"n": 2}},
        timeout=60,
    )
    assert answer.status_code == 400 and "'n'" in answer.json()["error"]


def test_the_extensions_are_accepted_on_every_door(server):
    """Beyond OpenAI's schema (vLLM's extra parameters, logprobs past 5): one range."""
    base = {"max_tokens": 2, "temperature": 0}
    body = {"model": "chat", "prompt": "hi", **base, **EXTENSIONS}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
    body = {"text_input": "hi", "parameters": {**base, **EXTENSIONS}}
    answer = httpx.post(server.url + "/v2/models/chat/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    body = {"inputs": _tensors("max_tokens", 2)}
    body["inputs"][1]["data"] = [json.dumps({**base, **EXTENSIONS})]
    answer = httpx.post(server.url + "/v2/models/chat/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
