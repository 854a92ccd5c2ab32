"""The detector backend's request checks and its per-request selection."""

import numpy as np
import pytest

from bitserve.config import load_config
from bitserve.vision.backend import DetectorModel, select

from .conftest import DETECTOR

CONFIG = load_config(DETECTOR / "config.toml")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 0, 128, 1), "zero-size image"),
        ((1, 128, 0, 3), "zero-size image"),
        ((1, 64, 64, 2), "2 channels"),
        ((1, 4096, 4097, 1), "parameters.max_image_pixels"),
    ],
)
def test_refuses_images_naming_the_field(shape, message):
    image = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape, (0,) * len(shape))
    with pytest.raises(ValueError, match=message) as refused:
        DetectorModel.validate(CONFIG, {"image": image})
    assert "input 'image'" in str(refused.value)


def test_refuses_parameters_out_of_range():
    image = np.zeros((1, 8, 8, 1), np.uint8)
    with pytest.raises(ValueError, match="'score_threshold'"):
        DetectorModel.validate(CONFIG, {"image": image, "score_threshold": np.array([[1.5]])})
    with pytest.raises(ValueError, match="'max_detections'"):
        DetectorModel.validate(CONFIG, {"image": image, "max_detections": np.array([[0]])})
    DetectorModel.validate(CONFIG, {"image": image, "max_detections": np.array([[100]])})


def test_select_thresholds_caps_and_pads_per_row():
    scores = np.array([[0.9, 0.8, 0.4, 0.1], [0.95, 0.2, 0.1, 0.0]], np.float32)
    boxes = np.tile(np.array([-5.0, 10.0, 50.0, 300.0], np.float32), (2, 4, 1))
    classes = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    out = select(boxes, scores, classes, np.array([0.3, 0.5]), np.array([2, 3]), (100, 40))
    assert out["num_detections"].tolist() == [[2], [1]]
    assert out["boxes"].shape == (2, 3, 4)  # padded to the largest cap in the batch
    assert out["classes"].tolist() == [[1, 2, -1], [5, -1, -1]]
    assert out["scores"][0].tolist() == pytest.approx([0.9, 0.8, 0.0])
    assert out["boxes"][0, 0].tolist() == [0.0, 10.0, 40.0, 100.0]  # clipped to the image
    assert not out["boxes"][1, 1:].any()


def test_the_session_takes_the_onnx_backends_providers(detector_graphs, tmp_path, monkeypatch):
    """The detector's session runs where the onnx backend's would (CUDA on a GPU instance)."""
    from bitserve.backends import onnx

    asked = []

    def providers(config, device):
        asked.append(device)
        return ["CPUExecutionProvider"]

    monkeypatch.setattr(onnx, "providers", providers)
    (tmp_path / "model.onnx").write_bytes(detector_graphs["teacher"].read_bytes())
    model = DetectorModel(CONFIG, tmp_path, device="cuda:0")
    model.load()
    assert asked == ["cuda:0"] and model.session.get_providers() == ["CPUExecutionProvider"]
