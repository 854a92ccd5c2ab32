"""End to end: minilm (fp32) as stable, its int8 quantization as the shadow.

The repository is built the way a user would: copy models/minilm, then
`bitserve quantize models/minilm models/minilm --method int8 --version 2` writes the
int8 weights as version 2 next to version 1; the config then serves both and mirrors
every request to version 2.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT, Server
from tests.rollout.conftest import mirrored_report

QUANTIZE = [sys.executable, "-m", "bitserve.cli", "quantize", "--threads", "1"]
TRAFFIC = """
[version_policy]
all = true

[traffic]
stable = 1
shadow = 2
shadow_percent = 100
shadow_queue_size = 256
"""

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A canary release sends a small share of traffic to the new version.",
    "Shadow traffic copies requests to a model whose answers are discarded.",
    "Quantized weights take a quarter of the memory of float32 ones.",
    "Paris is the capital of France.",
    "bitserve batches concurrent requests dynamically.",
]


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm") / "models"
    model = root / "minilm"
    shutil.copytree(ROOT / "models" / "minilm", model)
    quantize = subprocess.run(
        [*QUANTIZE, str(model), str(model), "--method", "int8", "--version", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert quantize.returncode == 0, quantize.stdout + quantize.stderr
    assert (model / "2").is_dir()
    with (model / "config.toml").open("a") as config:
        config.write(TRAFFIC)
    server = Server(root)
    yield server
    server.stop()


def test_report_shows_cosine_agreement_and_latency_for_both(minilm_server):
    n = 60
    with httpx.Client(base_url=minilm_server.url, timeout=60) as client:
        for i in range(n):
            text = SENTENCES[i % len(SENTENCES)]
            body = {
                "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]
            }
            answer = client.post("/v2/models/minilm/infer", json=body)
            assert answer.status_code == 200 and answer.json()["model_version"] == "1"
        report = mirrored_report(client, "minilm", n, timeout=60, every=0.5)
    comparison = report["shadow_comparison"]
    assert comparison["mirrored"] == n and comparison["shadow_errors"] == 0
    cosine = comparison["outputs"]["embedding"]["cosine"]
    print(f"int8 vs fp32 minilm: cosine mean {cosine['mean']:.5f} min {cosine['min']:.5f}")
    assert cosine["min"] > 0.98
    versions = {v["version"]: v for v in report["versions"]}
    for number, role in (("1", "stable"), ("2", "shadow")):
        assert versions[number]["role"] == role and versions[number]["requests"] == n
        assert versions[number]["latency_ms"]["mean"]["method"] == "normal"
        assert versions[number]["latency_ms"]["p50"]["value"] > 0
        print(f"version {number} ({role}) latency: {versions[number]['latency_ms']}")
    candidate = report["candidates"][0]
    assert candidate["role"] == "shadow" and candidate["agreement"]["embedding"]["cosine"]
    assert candidate["tests"]["latency_welch"] is not None
