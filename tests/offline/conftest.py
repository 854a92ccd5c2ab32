"""A small repository for batch tests and a helper that runs `bitserve batch`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_model
from tests.server.test_openai import build_llm

LLM_CONFIG = """
backend = "llm"
[parameters]
max_model_len = 128
num_kv_blocks = 256
system_prompt = "You are terse."
"""

DOUBLE = """
backend = "python"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [2]
[[input]]
name = "label"
datatype = "BYTES"
dims = [1]
[[output]]
name = "y"
datatype = "FP32"
dims = [2]
"""

DOUBLE_CODE = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""


@pytest.fixture(scope="session")
def batch_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("offline") / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(LLM_CONFIG)
    shutil.copytree(ROOT / "models" / "minilm", root / "minilm")
    write_model(root, "double", DOUBLE, DOUBLE_CODE)
    return root


def batch_command(repo: Path, inp: Path, out: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "bitserve.cli", "batch", "--repository", str(repo),
        "--input", str(inp), "--output", str(out), "--threads", "1", "--no-progress", *args,
    ]  # fmt: skip


def run_batch(repo: Path, inp: Path, out: Path, *args: str) -> str:
    """Run to the end; the summary line (stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        batch_command(repo, inp, out, *args), capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def key(doc: dict) -> str:
    return doc["custom_id"] or f"line:{doc['error']['line']}"


def openai_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def answers(path: Path) -> dict:
    """Each record's response body less its ids and timestamp, and its error."""
    out = {}
    for doc in read_output(path):
        body = (doc["response"] or {}).get("body") or {}
        out[key(doc)] = (
            {k: v for k, v in body.items() if k not in ("id", "created")},
            doc["error"],
        )
    return out


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
