"""A detector repository for the vision tests: the committed teacher exported to
version 1 and its int8 quantization as version 2 (seconds, no training)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT  # tests/conftest.py also pins OMP_NUM_THREADS to 1

DETECTOR = ROOT / "models" / "detector"


@pytest.fixture(scope="session")
def detector_graphs(tmp_path_factory) -> dict[str, Path]:
    """{"teacher": fp32 graph at 128 px, "int8": its QDQ int8 quantization}."""
    import torch

    from bitserve.vision import export, weights
    from bitserve.vision.optimize import techniques

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("graphs")
    teacher = export.export(weights.load(DETECTOR / "teacher.safetensors"), 128, folder / "t.onnx")
    calibration = techniques.calibration_images(count=16)
    int8 = techniques.quantize_int8(teacher, folder / "int8.onnx", calibration)
    return {"teacher": teacher, "int8": int8}


@pytest.fixture(scope="session")
def detector_repository(tmp_path_factory, detector_graphs) -> Path:
    """models/detector with version 1 (teacher) and 2 (int8) served, 2 shadowing 1."""
    repository = tmp_path_factory.mktemp("repo") / "models"
    folder = repository / "detector"
    shutil.copytree(DETECTOR, folder, ignore=shutil.ignore_patterns("optimize", "[0-9]*"))
    for version, name in ((1, "teacher"), (2, "int8")):
        (folder / str(version)).mkdir()
        shutil.copyfile(detector_graphs[name], folder / str(version) / "model.onnx")
    config = folder / "config.toml"
    config.write_text(
        config.read_text().replace("threads = 2", "threads = 1")  # tests: one thread
        + "\n[version_policy]\nall = true\n"
        + "\n[traffic]\nstable = 1\nshadow = 2\nshadow_percent = 100\nmin_agreement = 0.8\n"
    )
    return repository
