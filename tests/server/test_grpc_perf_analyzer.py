"""Triton's perf_analyzer measures bitserve over gRPC (unary and streaming) and HTTP
without errors. The binary does not install with pip on every machine
(/work/shared/research/perf-analyzer.md): the test runs when PERF_ANALYZER names it,
or `perf_analyzer` is on PATH, and skips otherwise."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess

import pytest

from tests.conftest import XY_CONFIG, Server, free_port, write_model

BINARY = os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")
pytestmark = pytest.mark.skipif(not BINARY, reason="no perf_analyzer binary here")
DOUBLE = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("perf_analyzer") / "models"
    config = XY_CONFIG.replace("dims = [1]", "dims = [512]")  # as the mlp's
    write_model(repo, "double", config + "[dynamic_batching]\n", DOUBLE)
    port = free_port()
    server = Server(repo, "--grpc-port", str(port))
    server.grpc = f"127.0.0.1:{port}"
    yield server
    server.stop()


@pytest.mark.parametrize("way", ["grpc", "grpc-streaming", "http", "http-json"])
def test_perf_analyzer_measures_without_errors(server, tmp_path, way):
    """http-json: its random FP32 data holds NaN and infinities, written as rapidjson
    writes them (NaN, Infinity), which Triton reads and so must bitserve."""
    url = server.grpc if way.startswith("grpc") else server.url.removeprefix("http://")
    out = tmp_path / "out.csv"
    command = [BINARY, "-m", "double", "-x", "1", "-i", way.split("-")[0], "-u", url]
    command += ["--concurrency-range", "4", "-p", "1000", "-s", "1000", "-r", "3", "-f", str(out)]
    if way == "grpc-streaming":
        command.append("--streaming")
    if way == "http-json":
        command += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "error" not in done.stdout.lower(), done.stdout
    (row,) = list(csv.DictReader(out.open()))
    assert float(row["Inferences/Second"]) > 0
