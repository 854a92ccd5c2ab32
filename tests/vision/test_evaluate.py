"""mAP from COCOeval: the ground truth scores 1, a shifted or mislabelled answer less."""

import numpy as np
import pytest

from bitserve.vision import data, evaluate


def _answer(canvases, shift=0.0, relabel=False):
    by_image = {c.image.tobytes(): c for c in canvases}

    def detect(images):
        rows = [by_image[image.tobytes()] for image in images]
        k = max(len(r.boxes) for r in rows)
        boxes = np.zeros((len(rows), k, 4), np.float32)
        scores = np.zeros((len(rows), k), np.float32)
        classes = np.zeros((len(rows), k), np.int64)
        for i, r in enumerate(rows):
            n = len(r.boxes)
            x, y, w, h = r.boxes.T
            boxes[i, :n] = np.stack([x + shift * w, y, x + w + shift * w, y + h], axis=1)
            scores[i, :n] = 0.9
            classes[i, :n] = (r.labels + 1) % 10 if relabel else r.labels
        return boxes, scores, classes

    return detect


def test_the_ground_truth_scores_one():
    canvases = data.heldout(30)
    result = evaluate.mean_ap(_answer(canvases), canvases)
    assert result["map"] == pytest.approx(1.0) and result["map50"] == pytest.approx(1.0)


def test_a_shifted_box_loses_the_strict_thresholds_only():
    canvases = data.heldout(30)
    result = evaluate.mean_ap(_answer(canvases, shift=0.2), canvases)
    # IoU of a box shifted by 20% of its width is 0.8/1.2 = 0.67: found at .5, not at .75+
    assert result["map50"] == pytest.approx(1.0)
    assert 0.2 < result["map"] < 0.5


def test_wrong_classes_score_zero():
    canvases = data.heldout(30)
    assert evaluate.mean_ap(_answer(canvases, relabel=True), canvases)["map"] == 0.0
