"""Quantized folders load like any model: through `bitserve serve` and through `LLM()`."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from bitserve.llm import LLM, SamplingParams
from bitserve.quantize.command import quantize
from tests.conftest import Server
from tests.quant.conftest import ROOT, TINYLM

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = "And the LORD spake unto Moses, saying,"


@pytest.fixture(scope="module")
def repository(tmp_path_factory, quantized_tinylm):
    repo = tmp_path_factory.mktemp("served") / "models"
    shutil.copytree(quantized_tinylm["int4"], repo / "tinylm-int4")
    (repo / "minilm" / "1").mkdir(parents=True)
    config = (ROOT / "models/minilm/config.toml").read_text()
    (repo / "minilm" / "config.toml").write_text(config + "\n[version_policy]\nall = true\n")
    args = [str(ROOT / "models/minilm"), str(repo / "minilm"), "--method", "int8"]
    result = CliRunner().invoke(quantize, [*args, "--version", "2"])
    assert result.exit_code == 0, result.output
    return repo


@pytest.fixture(scope="module")
def server(repository):
    server = Server(repository)
    yield server
    server.stop()


def test_llm_loads_a_quantized_folder(quantized_tinylm) -> None:
    fp32 = LLM(TINYLM / "1", num_kv_blocks=64).generate(PROMPT, GREEDY)[0].outputs[0]
    for method, folder in quantized_tinylm.items():
        out = LLM(folder / "1", num_kv_blocks=64).generate(PROMPT, GREEDY)[0].outputs[0]
        same = sum(a == b for a, b in zip(out.token_ids, fp32.token_ids, strict=True))
        print(method, repr(out.text), f"{same}/12 tokens as fp32")
        assert len(out.token_ids) == 12 and out.text.strip()
        if method == "int8":
            assert same >= 6


def test_served_quantized_llm_answers_as_llm_offline(server, quantized_tinylm) -> None:
    body = {"model": "tinylm-int4", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    offline = LLM(quantized_tinylm["int4"] / "1", num_kv_blocks=64).generate(PROMPT, GREEDY)
    assert answer.json()["choices"][0]["text"] == offline[0].outputs[0].text


def test_served_int8_minilm_version_2_next_to_fp32_version_1(server) -> None:
    def embed(version: int) -> np.ndarray:
        texts = ["A cat sat on the mat.", "Quantized weights, served."]
        body = {"inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": texts}]}
        url = f"{server.url}/v2/models/minilm/versions/{version}/infer"
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return np.array(answer.json()["outputs"][0]["data"]).reshape(2, 384)

    fp32, int8 = embed(1), embed(2)
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert cosine.min() >= 0.99 and not np.array_equal(fp32, int8)


def test_batch_runs_the_quantized_models_as_the_server_does(server, repository, tmp_path) -> None:
    from tests.offline.conftest import openai_line, read_output, run_batch

    completion = {"model": "tinylm-int4", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    inp = tmp_path / "in.jsonl"
    inp.write_text(openai_line("c", "/v1/completions", completion) + "\n")
    out = tmp_path / "out.jsonl"
    run_batch(repository, inp, out)
    (doc,) = read_output(out)
    online = httpx.post(server.url + "/v1/completions", json=completion, timeout=60).json()
    assert doc["error"] is None
    assert doc["response"]["body"]["choices"][0]["text"] == online["choices"][0]["text"]
