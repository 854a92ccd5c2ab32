"""An LLM shadow over v2 infer: tinylm against a copy of itself agrees exactly (greedy),
and the comparison is by exact match and token agreement."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.conftest import ROOT, Server
from tests.rollout.conftest import mirrored_report

TOKEN = "llm-rollout"
TRAFFIC = """
[version_policy]
all = true

[traffic]
stable = 1
shadow = 2
"""


@pytest.fixture(scope="module")
def llm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm") / "models"
    model = root / "tinylm"
    model.mkdir(parents=True)
    config = (ROOT / "models" / "tinylm" / "config.toml").read_text()
    (model / "config.toml").write_text(config + TRAFFIC)
    for version in ("1", "2"):
        shutil.copytree(ROOT / "models" / "tinylm" / "1", model / version)
    server = Server(root, "--admin-token", TOKEN)
    yield server
    server.stop()


def test_llm_shadow_compares_text_by_exact_match_and_tokens(llm_server):
    params = json.dumps({"temperature": 0, "max_tokens": 8})
    body = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["In the beginning"]},
            {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [params]},
        ]
    }
    with httpx.Client(base_url=llm_server.url, timeout=60) as client:
        for _ in range(5):
            answer = client.post("/v2/models/tinylm/infer", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model_version"] == "1"
        report = mirrored_report(client, "tinylm", 5, timeout=30, every=0.2)
    figures = report["shadow_comparison"]["outputs"]["text_output"]
    assert figures["exact_match"]["mean"] == 1.0
    assert figures["token_agreement"]["mean"] == 1.0


def test_openai_and_generate_follow_the_traffic_policy(llm_server):
    """Without a policy the highest version (2) would answer; the policy says 1, then
    a canary 2 at 100%."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    path = "/v2/repository/models/tinylm/traffic"
    body = {"model": "tinylm", "prompt": "And God said", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=llm_server.url, timeout=60) as client:
        for change, answering in (
            ({"shadow": None}, "1"),
            ({"canary": 2, "canary_weight": 100}, "2"),
        ):
            changed = client.patch(path, json=change, headers=auth)
            assert changed.status_code == 200, changed.text
            before = _tokens(client.get("/metrics").text)
            for _ in range(3):
                assert client.post("/v1/completions", json=body).status_code == 200
            after = _tokens(client.get("/metrics").text)
            grew = {v for v in after if after[v] > before.get(v, 0)}
            assert grew == {answering}
            generated = client.post(
                "/v2/models/tinylm/generate",
                json={"text_input": "Amen", "parameters": {"max_tokens": 2}},
            )
            assert generated.json()["model_version"] == answering


def _tokens(metrics: str) -> dict[str, float]:
    prefix = 'bitserve_llm_generation_tokens_total{model="tinylm",version="'
    return {
        line[len(prefix)]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
    }
