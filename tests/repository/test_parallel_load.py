"""Loads that cannot race: two versions of every default model kind load side by side
(versions load in parallel threads), every start, and a canary split over them serves.

torch.export's deserializer is process-global: two `model.pt2` versions loading at once
failed ("_CURRENT_DESERIALIZER is already set") three starts out of three before the
torch backend serialised its loads.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import httpx

from bitserve.repository.repository import Repository
from tests.conftest import ROOT, XY_CONFIG, Server, write_model

ALL_VERSIONS = "\n[version_policy]\nall = true\n"
CANARY = "\n[traffic]\nstable = 1\ncanary = 2\ncanary_weight = 50\n"
ECHO = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""
PYTHON = XY_CONFIG


def two_versions(repo: Path, names: list[str], extra: dict[str, str] | None = None) -> None:
    """Each default model (and a python one) with version 2 a copy of version 1."""
    sys.path.insert(0, str(ROOT / "tools"))
    from build_models import BUILDERS, build

    for name in names:
        shutil.copytree(ROOT / "models" / name, repo / name)
    build(repo, names=[n for n in names if n in BUILDERS])
    write_model(repo, "echo", PYTHON, ECHO)
    for name in [*names, "echo"]:
        shutil.copytree(repo / name / "1", repo / name / "2")
        config = repo / name / "config.toml"
        config.write_text(config.read_text() + ALL_VERSIONS + (extra or {}).get(name, ""))


async def _start(repo: Path) -> dict[str, list[int]]:
    repository = Repository(repo)
    repository.scan()
    try:
        await repository.load_all()
        return {
            name: sorted(n for n, v in entry.versions.items() if v.ready)
            for name, entry in repository.models.items()
        }
    finally:
        await repository.unload_all()


def test_ten_starts_load_two_versions_of_each_cheap_kind(tmp_path):
    two_versions(tmp_path, ["mlp", "bow_classifier"])
    for _ in range(10):
        ready = asyncio.run(_start(tmp_path))
        assert ready == {"mlp": [1, 2], "bow_classifier": [1, 2], "echo": [1, 2]}


def test_every_default_kind_serves_two_versions_with_a_canary_split(tmp_path):
    repo = tmp_path / "models"
    two_versions(repo, ["mlp", "bow_classifier", "minilm", "tinylm"], {"mlp": CANARY})
    server = Server(repo)
    try:
        client = httpx.Client(base_url=server.url, timeout=60)
        for name in ("mlp", "bow_classifier", "minilm", "tinylm", "echo"):
            for version in (1, 2):
                assert client.get(f"/v2/models/{name}/versions/{version}/ready").status_code == 200
        answered = set()
        row = {"name": "INPUT0", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}
        name = client.get("/v2/models/mlp").json()["inputs"][0]["name"]
        row["name"] = name
        for _ in range(40):
            answer = client.post("/v2/models/mlp/infer", json={"inputs": [row]})
            assert answer.status_code == 200, answer.text
            answered.add(answer.json()["model_version"])
        assert answered == {"1", "2"}  # the split reaches both versions
        for version in (1, 2):
            reply = client.post(
                f"/v2/models/tinylm/versions/{version}/generate",
                json={"text_input": "In the beginning", "parameters": {"max_tokens": 4}},
            )
            assert reply.status_code == 200, reply.text
        log = server.log.read_text()
        assert "ready" in log and "NOT ready" not in log
    finally:
        server.stop()


def test_the_startup_log_says_not_ready_and_names_what_failed(tmp_path):
    write_model(tmp_path, "echo", PYTHON, ECHO)
    write_model(tmp_path, "broken", PYTHON, "raise RuntimeError('no weights here')\n")
    server = Server(tmp_path, wait_ready=False)
    try:
        deadline = 60
        while deadline and "loading ended" not in server.log.read_text():
            deadline -= 1
            asyncio.run(asyncio.sleep(1))
        log = server.log.read_text()
        assert "loading ended, NOT ready: model 'broken'" in log
        assert "after process start" not in log
        assert httpx.get(server.url + "/v2/health/ready").status_code == 503
    finally:
        server.stop()
