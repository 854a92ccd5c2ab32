"""`bitserve bench` end to end: against a real bitserve (v2) and an independent
OpenAI-compatible server (LitServe), producing the JSON, the table and both plots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from bitserve.cli import main
from bitserve.loadtest.command import check_target
from tests.conftest import ROOT, Server, free_port, write_model
from tests.loadtest.conftest import wait_http

SLEEPER = """
import time

class Model:
    def predict(self, inputs):
        time.sleep(0.005)
        return {"y": inputs["x"]}
"""
CONFIG = """
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
[dynamic_batching]
max_queue_delay_ms = 2
"""
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"


def bench(*args: str) -> str:
    answer = CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    return answer.output


def check_report(folder: Path) -> dict:
    result = json.loads((folder / "result.json").read_text())
    for png in ("throughput_latency.png", "ttft_cdf.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


@pytest.fixture(scope="module")
def bitserve(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    write_model(root / "models", "sleeper", CONFIG, SLEEPER)
    server = Server(root / "models")
    yield server
    server.stop()


def test_v2_sweep_against_bitserve(bitserve, tmp_path):
    out = bench(
        bitserve.url, "--model", "sleeper", "--concurrency", "1,16", "--num-requests", "160",
        "--warmup", "16", "--goodput", "e2el:500", "--report-dir", str(tmp_path / "a"),
    )  # fmt: skip
    result = check_report(tmp_path / "a")
    assert [p["load"] for p in result["points"]] == ["c=1", "c=16"]
    assert "E2E p99" in out and "srv batch" in out and "c=16" in out
    one, many = result["points"]
    assert one["completed"] == many["completed"] == 160 and not one["errors"]
    assert one["server"]["requests"] == 160 and one["server"]["mean_batch_size"] == 1.0
    assert many["server"]["mean_batch_size"] > 1.5  # concurrency lets the batcher batch
    assert one["e2el"]["median_ms"] >= 5.0 and one["server"]["mean_compute_ms"] >= 5.0
    # rate sweep, then compare the two JSON files
    bench(
        bitserve.url, "--model", "sleeper", "--rate", "100", "--num-requests", "100",
        "--burstiness", "0.5", "--report-dir", str(tmp_path / "b"), "--no-plots",
    )  # fmt: skip
    text = bench(
        "compare", str(tmp_path / "a" / "result.json"), str(tmp_path / "a" / "result.json")
    )
    assert "req/s" in text and "1.00" in text


def test_openai_chat_against_litserve(tmp_path):
    if (
        not BENCH_PYTHON.exists()
        or subprocess.run([BENCH_PYTHON, "-c", "import litserve"]).returncode
    ):
        pytest.skip("LitServe lives in .venv-bench (make .venv-bench/.installed)")
    port = free_port()
    peer = ROOT / "bench" / "peers" / "litserve_openai.py"
    args = [
        str(BENCH_PYTHON),
        str(peer),
        "--port",
        str(port),
        "--prefill-ms",
        "20",
        "--token-ms",
        "2",
    ]
    process = subprocess.Popen(args, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", process, limit=90)
        out = bench(
            url, "--model", "ticker", "--api", "chat", "--concurrency", "1,2",
            "--num-requests", "12", "--input-len", "50", "--output-len", "16",
            "--length-dist", "fixed", "--goodput", "ttft:500", "tpot:50",
            "--report-dir", str(tmp_path), "--no-progress",
        )  # fmt: skip
    finally:  # LitServe's workers are children: stop the whole session
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(20)
    result = check_report(tmp_path)
    assert "TTFT p99" in out and "TPOT p50" in out
    for point in result["points"]:
        assert point["completed"] == 12 and point["total_output_tokens"] == 12 * 16
        assert point["total_input_tokens"] == 12 * 50
        assert point["ttft"]["median_ms"] >= 20.0 and point["goodput"]["requests"] > 0
        assert point["server"] is None  # not bitserve: no server-side view


def test_only_loopback_targets_unless_allowed():
    check_target("http://127.0.0.1:8000", False)
    check_target("http://localhost:8000", False)
    with pytest.raises(ValueError, match="loopback"):
        check_target("http://10.1.2.3:8000", False)
    check_target("http://10.1.2.3:8000", True)
    with pytest.raises(ValueError, match="http://"):
        check_target("https://127.0.0.1", False)


def test_every_prompt_of_a_run_is_distinct_warmup_included(jittery_server, tmp_path):
    """16 users on a server whose answers finish in a shuffled order: each of the 16
    warm-up and 64 measured prompts reaches it once. A repeated prompt would be a prefix
    cache hit, and how many there are would depend on each server's completion order."""
    bench(
        jittery_server, "--model", "m", "--api", "completions", "--concurrency", "16",
        "--num-requests", "64", "--warmup", "16", "--input-len", "30", "--output-len", "6",
        "--length-dist", "fixed", "--ignore-eos", "--report-dir", str(tmp_path),
        "--no-plots", "--no-progress",
    )  # fmt: skip
    prompts = httpx.get(jittery_server + "/prompts").json()
    assert len(prompts) == 80
    assert len(set(prompts)) == 80
