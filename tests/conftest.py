"""Shared fixtures: a real `bitserve serve` process on a loopback port.

torch is pinned to one thread in tests (on a loaded 2-core box, two OpenMP threads
collapse: `python -m bench.kernels --threads 2` shows it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval reads local files only
# Triton kernels run in Triton's interpreter (no GPU here); triton reads this when it is
# imported, so it is set before any test module imports it. On a GPU, TRITON_INTERPRET=0
# runs tests/llm/test_triton_attention.py on the device instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `bitserve serve` subprocess; `url` once it answers ready."""

    def __init__(
        self, repository: Path, *args: str, wait_ready: bool = True, env: dict | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = repository.parent / f"server-{self.port}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        command = [sys.executable, "-m", "bitserve.cli", "serve", "--repository", str(repository)]
        command += ["--port", str(self.port), "--threads", "1", *args]
        if "--grpc-port" not in args:  # gRPC only where a test asks: 8001 is not shared
            command += ["--grpc-port", "0"]
        self.process = subprocess.Popen(
            command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env
        )
        self._wait("/v2/health/ready" if wait_ready else "/v2/health/live")

    def _wait(self, path: str, limit: float = 120.0) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                answer = httpx.get(self.url + path, timeout=1.0)
                if answer.status_code == 200:
                    return
                if "failed" in answer.text:
                    self.stop()
                    raise RuntimeError(f"{answer.text}\n{self.log.read_text()}")
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready in {limit} s:\n{self.log.read_text()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# A python model's config head: x (FP32 [1]) -> y (FP32 [1]), batches of up to 8 rows.
# Tests append their own outputs and tables.
XY_CONFIG = """
backend = "python"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [1]
[[output]]
name = "y"
datatype = "FP32"
dims = [1]
"""


def write_model(repository: Path, name: str, config: str, code: str | None = None) -> Path:
    """A model folder: config.toml and, for python models, 1/model.py."""
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(textwrap.dedent(config))
    if code is not None:
        (folder / "1" / "model.py").write_text(textwrap.dedent(code))
    return folder


@pytest.fixture(scope="session")
def default_repository(tmp_path_factory) -> Path:
    """A copy of models/ with its generated weights built (tools/build_models.py)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from build_models import build

    target = tmp_path_factory.mktemp("default") / "models"
    shutil.copytree(ROOT / "models", target)
    build(target)
    return target


@pytest.fixture(scope="session")
def default_server(default_repository) -> Iterator[Server]:
    server = Server(default_repository)
    yield server
    server.stop()
