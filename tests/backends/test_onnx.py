"""The onnx backend on the generated bag-of-words classifier, against numpy."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve.backends import onnx
from bitserve.backends.base import LoadError
from bitserve.backends.onnx import OnnxModel
from bitserve.config import ModelConfig, load_config

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


def import_build_models():
    spec = importlib.util.spec_from_file_location("build_models", ROOT / "tools/build_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_models = import_build_models()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A copy of models/bow_classifier with its model.onnx built."""
    repository = tmp_path_factory.mktemp("models")
    shutil.copytree(ROOT / "models/bow_classifier", repository / "bow_classifier")
    build_models.build(repository, names=["bow_classifier"])
    return repository / "bow_classifier"


@pytest.fixture(scope="module")
def model(repo: Path) -> OnnxModel:
    instance = OnnxModel(load_config(repo / "config.toml"), repo / "1")
    instance.load()
    return instance


def reference(rows: list[list[int]]) -> np.ndarray:
    """softmax(mean of the rows' embeddings @ W + b), one row at a time, unpadded."""
    w = build_models.bow_weights()
    out = []
    for ids in rows:
        mean = w["embedding"][ids].mean(0) if ids else np.zeros(w["embedding"].shape[1])
        logits = mean @ w["weight"] + w["bias"]
        e = np.exp(logits - logits.max())
        out.append(e / e.sum())
    return np.array(out, dtype=np.float32)


def pad(rows: list[list[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    width = width or max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def test_matches_numpy(model: OnnxModel) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 1000, size=n).tolist() for n in (1, 5, 17, 3)]
    ids, mask = pad(rows)
    out = model.predict({"input_ids": ids, "mask": mask})
    assert list(out) == ["probs"] and out["probs"].shape == (4, 4)
    np.testing.assert_allclose(out["probs"], reference(rows), rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_a_row(model: OnnxModel) -> None:
    row = [7, 300, 999, 42]
    alone = model.predict(dict(zip(("input_ids", "mask"), pad([row]), strict=True)))["probs"]
    ids, mask = pad([row, list(range(30))], width=40)  # padded to 40 beside a longer row
    batched = model.predict({"input_ids": ids, "mask": mask})["probs"]
    np.testing.assert_allclose(batched[0], alone[0], rtol=1e-6, atol=1e-7)
    ids, mask = pad([[]], width=3)  # all padding: the bias's softmax, not NaN
    np.testing.assert_allclose(
        model.predict({"input_ids": ids, "mask": mask})["probs"], reference([[]]), rtol=1e-6
    )


def test_inputs_are_cast_to_the_graph_dtype(model: OnnxModel) -> None:
    ids, mask = pad([[1, 2, 3], [4]])
    as_int64 = model.predict({"input_ids": ids, "mask": mask})["probs"]
    cast = model.predict({"input_ids": ids.astype(np.int32), "mask": mask.astype(bool)})["probs"]
    np.testing.assert_array_equal(cast, as_int64)


def test_threads_reach_the_session(repo: Path) -> None:
    raw = load_config(repo / "config.toml").model_dump()
    config = ModelConfig.model_validate(raw | {"instance_group": {"threads": 1}})
    instance = OnnxModel(config, repo / "1")
    instance.load()
    assert instance.session.get_session_options().intra_op_num_threads == 1
    assert instance.session.get_providers() == ["CPUExecutionProvider"]


def test_load_errors_name_the_file(repo: Path, tmp_path: Path) -> None:
    raw = load_config(repo / "config.toml").model_dump() | {"model_warmup": []}
    with pytest.raises(LoadError, match=r"no model\.onnx"):
        OnnxModel(ModelConfig.model_validate(raw), tmp_path).load()
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(LoadError, match=str(tmp_path / "model.onnx")):
        OnnxModel(ModelConfig.model_validate(raw), tmp_path).load()

    renamed = raw | {"input": [raw["input"][0] | {"name": "ids"}]}
    with pytest.raises(LoadError, match=r"model\.onnx: the graph has inputs"):
        OnnxModel(ModelConfig.model_validate(renamed), repo / "1").load()
    no_mask = raw | {"input": [raw["input"][0] | {"mask": None, "ragged": False}]}
    with pytest.raises(LoadError, match="inputs"):
        OnnxModel(ModelConfig.model_validate(no_mask), repo / "1").load()
    other_output = raw | {"output": [raw["output"][0] | {"name": "logits"}]}
    with pytest.raises(LoadError, match=r"outputs \['probs'\]"):
        OnnxModel(ModelConfig.model_validate(other_output), repo / "1").load()


def test_providers_put_cuda_first_only_on_a_gpu_instance(repo: Path, monkeypatch) -> None:
    raw = load_config(repo / "config.toml").model_dump()
    auto = ModelConfig.model_validate(raw)
    on_cpu = ModelConfig.model_validate(raw | {"instance_group": {"kind": "cpu"}})
    assert onnx.providers(auto, "cuda:1") == ["CPUExecutionProvider"]  # no CUDA build here
    monkeypatch.setattr(
        onnx.ort,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    cuda = ("CUDAExecutionProvider", {"device_id": 1})
    assert onnx.providers(auto, "cuda:1") == [cuda, "CPUExecutionProvider"]
    assert onnx.providers(auto, "cuda") == [
        ("CUDAExecutionProvider", {"device_id": 0}),
        "CPUExecutionProvider",
    ]
    assert onnx.providers(on_cpu, "cuda:1") == ["CPUExecutionProvider"]
    assert onnx.providers(auto, "cpu") == ["CPUExecutionProvider"]


def test_the_log_says_which_provider_the_session_took(repo: Path, caplog) -> None:
    """A GPU instance on onnxruntime's CPU build (this one) runs, and says so."""
    with caplog.at_level(logging.INFO, logger="bitserve.backends.onnx"):
        OnnxModel(load_config(repo / "config.toml"), repo / "1", device="cuda").load()
    assert "onnxruntime on CPUExecutionProvider" in caplog.text
    assert "no CUDAExecutionProvider" in caplog.text and "bitserve[gpu]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bitserve.backends.onnx"):
        OnnxModel(load_config(repo / "config.toml"), repo / "1").load()
    assert "onnxruntime on CPUExecutionProvider" in caplog.text
    assert "CUDAExecutionProvider" not in caplog.text
