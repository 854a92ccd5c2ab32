"""The network, its targets, and the exported graph against torch."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from bitserve.vision import export, net, weights

torch.set_num_threads(1)


def test_targets_peak_at_the_centre_cell_with_the_size():
    boxes = np.array([[40.0, 20.0, 16.0, 24.0]], np.float32)  # centre (48, 32) px
    heat, reg, mask = net.targets([boxes], [np.array([7])], 128)
    assert heat.shape == (1, 10, 32, 32)
    assert heat[0, 7, 8, 12] == 1.0 and heat[0, 7].sum() > 1  # a Gaussian, peak at cell
    assert heat[0, :7].sum() == 0
    assert mask[0, 8, 12] == 1 and mask.sum() == 1
    assert reg[0, :, 8, 12].tolist() == pytest.approx([4.0, 6.0, 0.0, 0.0])


def test_targets_scale_with_the_resolution():
    boxes = np.array([[40.0, 20.0, 16.0, 24.0]], np.float32)
    heat, reg, _ = net.targets([boxes], [np.array([1])], 64)
    assert heat.shape[-1] == 16 and heat[0, 1, 4, 6] == 1.0
    assert reg[0, :2, 4, 6].tolist() == pytest.approx([2.0, 3.0])


def test_student_widths_halve_the_teacher():
    teacher, student = net.CenterNet(net.TEACHER_WIDTHS), net.CenterNet(net.STUDENT_WIDTHS)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(student) < count(teacher) / 3


@pytest.mark.parametrize("resolution", [128, 96])
def test_exported_graph_matches_torch_at_any_image_size(tmp_path, resolution):
    torch.manual_seed(0)
    model = net.CenterNet(net.STUDENT_WIDTHS).eval()
    path = export.export(model, resolution, tmp_path / "d.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    image = np.random.default_rng(0).integers(0, 255, (2, 150, 200, 3), dtype=np.uint8)
    boxes, scores, classes = session.run(None, {"image": image})
    assert boxes.shape == (2, net.TOP_K, 4) and scores.shape == classes.shape == (2, net.TOP_K)
    with torch.inference_mode():
        expected = net.Deployed(model, resolution)(torch.from_numpy(image))
    np.testing.assert_allclose(scores, expected[1].numpy(), atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    for row in range(2):  # equal scores may come in any order: compare as sets,
        above = scores[row] > scores[row, -1]  # of the peaks above a tie at the K-th
        ours = _rows(np.c_[scores[row], boxes[row]][above])
        theirs = _rows(np.c_[expected[1][row].numpy(), expected[0][row].numpy()][above])
        np.testing.assert_allclose(ours, theirs, atol=1e-3)


def _rows(table: np.ndarray) -> np.ndarray:
    return table[np.lexsort(np.round(table, 3).T[::-1])]


def test_teacher_finds_the_digits_in_image_pixels():
    """The committed teacher on a held-out canvas, and on the same canvas at 2x: the
    boxes come back in each image's own coordinates."""
    from bitserve.vision import data

    teacher = weights.load(export.Path(__file__).parents[2] / "models/detector/teacher.safetensors")
    canvas = data.heldout(1)[0]
    big = np.kron(canvas.image, np.ones((2, 2), np.uint8))
    with torch.inference_mode():
        small_out = net.Deployed(teacher, 128)(torch.from_numpy(canvas.image[None, ..., None]))
        big_out = net.Deployed(teacher, 128)(torch.from_numpy(big[None, ..., None]))
    n = len(canvas.boxes)
    assert sorted(small_out[2][0, :n].tolist()) == sorted(canvas.labels.tolist())
    np.testing.assert_allclose(big_out[0][0, :n].numpy(), 2 * small_out[0][0, :n].numpy(), atol=3)
