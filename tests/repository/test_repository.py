"""Discovery, version policy, and refusing broken models while the rest serve."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bitserve.config import ConfigError, ModelConfig, load_config
from bitserve.repository.repository import ModelNotFound, ModelUnavailable, Repository
from tests.conftest import Server, write_model

GOOD = """
backend = "python"
max_batch_size = 4
[[input]]
name = "x"
datatype = "FP32"
dims = [2]
[[output]]
name = "y"
datatype = "FP32"
dims = [2]
"""

ECHO = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


def versioned(root, name, versions, policy=""):
    folder = write_model(root, name, GOOD + policy, ECHO)
    for v in versions:
        (folder / str(v)).mkdir(exist_ok=True)
        (folder / str(v) / "model.py").write_text(f"VERSION = {v}\n" + ECHO)
    return folder


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [3]),
        ("[version_policy]\nlatest = 2\n", [2, 3]),
        ("[version_policy]\nall = true\n", [1, 2, 3]),
        ("[version_policy]\nspecific = [1, 3, 9]\n", [1, 3]),
    ],
)
def test_version_policy(tmp_path, policy, expected):
    versioned(tmp_path, "m", [1, 2, 3], policy)
    (tmp_path / "m" / "01").mkdir()  # Triton ignores names starting with 0
    (tmp_path / "m" / "notes").mkdir()
    repo = Repository(tmp_path)
    repo.scan()
    assert sorted(repo.models["m"].versions) == expected


def test_lookup_picks_the_highest_ready_version(tmp_path):
    versioned(tmp_path, "m", [1, 2], "[version_policy]\nall = true\n")
    repo = Repository(tmp_path)
    repo.scan()

    async def go():
        await repo.load_all()
        assert repo.get("m").version == 2
        assert repo.get("m", "1").version == 1
        with pytest.raises(ModelNotFound, match="unknown version '5'"):
            repo.get("m", "5")
        with pytest.raises(ModelNotFound, match="unknown model 'q'"):
            repo.get("q")
        await repo.unload_all()
        with pytest.raises(ModelUnavailable):
            repo.get("m")

    asyncio.run(go())


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("backend = 'python'\nmax_batch_size = -1\n", ["max_batch_size"]),
        ("backend = 'tensorflow'\n", ["backend"]),
        (
            "backend = 'python'\n[[input]]\nname='x'\ndatatype='FP33'\ndims=[1]\n",
            ["input.0", "FP33"],
        ),
        ("backend = 'python'\n[[input]]\nname='x'\ndatatype='FP32'\ndims=[0]\n", ["dims"]),
        ("backend = 'python'\n[dynamic_batching]\n", ["max_batch_size > 0"]),
        (
            "backend = 'python'\nmax_batch_size = 4\n"
            "[dynamic_batching]\npreferred_batch_sizes=[8]\n",
            ["preferred batch size 8"],
        ),
        (
            "backend = 'python'\nmax_batch_size = 4\n"
            "[dynamic_batching]\nmax_queue_delay_ms = 'x'\n",
            ["dynamic_batching.max_queue_delay_ms"],
        ),
        ("backend = 'python'\n[version_policy]\nlatest = 1\nall = true\n", ["latest, all"]),
        ("backend = 'python'\nmax_batchsize = 4\n", ["max_batchsize"]),
        ("backend = [", ["invalid TOML"]),
        ("name = 'other'\nbackend = 'python'\n", ["name", "folder"]),
    ],
)
def test_broken_config_names_file_and_field(tmp_path, text, words):
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_full_shape_adds_the_batch_dimension():
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": 2,
            "input": [{"name": "x", "datatype": "FP32", "dims": [-1, 3]}],
        }
    )
    assert config.full_shape(config.input[0]) == [-1, -1, 3]


def test_broken_models_are_refused_and_the_rest_serve(tmp_path):
    root = tmp_path / "models"
    versioned(root, "good", [1])
    write_model(root, "bad_config", "backend = 'python'\nmax_batch_size = 'lots'\n")
    write_model(root, "bad_import", GOOD, "import not_a_module_anywhere\n")
    write_model(
        root,
        "bad_setup",
        GOOD,
        "class Model:\n    def setup(self):\n        raise RuntimeError('no GPU')\n"
        "    def predict(self, inputs):\n        return inputs\n",
    )
    write_model(root, "no_versions", GOOD).joinpath("1").rmdir()
    server = Server(root, wait_ready=False)
    try:
        url = server.url
        deadline = 50
        while deadline and "loading" in httpx.get(url + "/v2/health/ready").text:
            deadline -= 1
            httpx.get(url + "/v2/health/live")
        ready = httpx.get(url + "/v2/health/ready")
        assert ready.status_code == 503 and "failed" in ready.json()["error"]
        good = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        assert httpx.post(url + "/v2/models/good/infer", json=good).status_code == 200
        causes = {
            "bad_config": ["config.toml", "max_batch_size"],
            "bad_import": ["model.py", "not_a_module_anywhere"],
            "bad_setup": ["model.py", "setup", "no GPU"],
            "no_versions": ["no numeric version folder"],
        }
        for model, words in causes.items():
            r = httpx.post(f"{url}/v2/models/{model}/infer", json=good)
            assert r.status_code == 503, (model, r.text)
            for word in words:
                assert word in r.json()["error"], (model, r.text)
            assert httpx.get(f"{url}/v2/models/{model}/ready").status_code == 503
        assert server.alive()
    finally:
        server.stop()


def test_marked_and_hidden_folders_are_skipped(tmp_path):
    versioned(tmp_path, "m", [1])
    versioned(tmp_path, "wip", [1])
    (tmp_path / "wip" / ".bitserve-ignore").touch()
    versioned(tmp_path, ".hidden", [1])
    repo = Repository(tmp_path)
    repo.scan()
    assert list(repo.models) == ["m"]


RENDEZVOUS = """
import time
from pathlib import Path


class Model:
    def setup(self, model_dir):
        # Each model's load waits for the other's to have started: only loads that
        # really run at the same time both finish.
        here = Path(model_dir).parent
        (here.parent / f"{here.name}.started").touch()
        other = here.parent / ("b" if here.name == "a" else "a")
        deadline = time.monotonic() + 30
        while not (other.parent / f"{other.name}.started").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{here.name} loaded alone: loads ran one at a time")
            time.sleep(0.01)

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


async def test_models_load_in_parallel(tmp_path):
    for name in ("a", "b"):
        write_model(tmp_path, name, GOOD, RENDEZVOUS)
    repository = Repository(tmp_path)
    repository.scan()
    await asyncio.wait_for(repository.load_all(), 60)
    try:
        assert {n: e.error for n, e in repository.models.items()} == {"a": None, "b": None}
        assert all(v.ready for e in repository.models.values() for v in e.versions.values())
    finally:
        await repository.unload_all()


def test_instances_on_a_gpu_get_cuda_and_tf32(monkeypatch):
    """kind auto or gpu on a machine with a GPU: cuda, with TF32 for fp32 matmuls."""
    import torch

    from bitserve.repository.loading import device_for

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    matmul = torch.backends.cuda.matmul
    assert device_for("auto") == "cpu" and matmul.allow_tf32 is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        assert device_for("cpu") == "cpu" and matmul.allow_tf32 is False
        assert device_for("gpu") == "cuda" and matmul.allow_tf32 is True
    finally:
        matmul.allow_tf32 = False
