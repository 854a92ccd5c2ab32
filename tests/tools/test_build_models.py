"""tools/build_models.py: the generated models load with the repository's own configs."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from bitserve.backends.onnx import OnnxModel
from bitserve.backends.torch import TorchModel
from bitserve.config import load_config

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["mlp/1/model.pt2", "bow_classifier/1/model.onnx", "detector/1/model.onnx"]


def import_build_models():
    spec = importlib.util.spec_from_file_location("build_models", ROOT / "tools/build_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_models = import_build_models()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A copy of the default repository's configs with the generated files built."""
    repository = tmp_path_factory.mktemp("repo") / "models"
    shutil.copytree(ROOT / "models", repository, ignore=shutil.ignore_patterns(*GENERATED))
    for relative in GENERATED:
        (repository / relative).unlink(missing_ok=True)  # a developer's built copy
    written = build_models.build(repository)
    assert sorted(written) == sorted(repository / g for g in GENERATED)
    return repository


def test_mlp_is_the_specified_network(repo: Path) -> None:
    program = torch.export.load(repo / "mlp/1/model.pt2")
    weights = [t for _, t in sorted(program.state_dict.items())]
    assert sum(t.numel() for t in weights) == 2_099_712  # 512*1024 + 1024^2 + 1024*512 + biases
    assert [tuple(w.shape) for w in weights if w.dim() == 2] == [
        (1024, 512),
        (1024, 1024),
        (512, 1024),
    ]
    assert all(t.dtype == torch.float32 for t in weights)

    model = TorchModel(load_config(repo / "mlp/config.toml"), repo / "mlp/1")
    model.load()
    (w0, b0), (w1, b1), (w2, b2) = [
        (program.state_dict[f"{i}.weight"], program.state_dict[f"{i}.bias"]) for i in (0, 2, 4)
    ]
    for batch in (1, 64, 1024):  # the exported batch range is 1..1024
        x = torch.randn(batch, 512)
        expected = torch.relu(torch.relu(x @ w0.T + b0) @ w1.T + b1) @ w2.T + b2
        torch.testing.assert_close(model.predict({"x": x.numpy()})["y"], expected)


def test_bow_classifier_is_valid_onnx_and_serves(repo: Path) -> None:
    path = repo / "bow_classifier/1/model.onnx"
    onnx.checker.check_model(onnx.load(path), full_check=True)
    model = OnnxModel(load_config(repo / "bow_classifier/config.toml"), path.parent)
    model.load()
    probs = model.predict(
        {"input_ids": np.zeros((2, 8), np.int64), "mask": np.ones((2, 8), np.int64)}
    )["probs"]
    assert probs.shape == (2, 4) and np.allclose(probs.sum(1), 1)


def test_rebuild_skips_existing_and_force_is_deterministic(repo: Path) -> None:
    before = {g: digest(repo / g) for g in GENERATED}
    assert build_models.build(repo) == []
    build_models.main(["--repository", str(repo), "--force"])
    assert {g: digest(repo / g) for g in GENERATED} == before
    assert not list(repo.glob("*/1/*.partial*"))


def test_repository_configs_validate() -> None:
    for name in ("minilm", "mlp", "bow_classifier"):
        config = load_config(ROOT / "models" / name / "config.toml")
        assert config.name == name and config.model_warmup
        assert (ROOT / "models" / name / "README.md").is_file()
