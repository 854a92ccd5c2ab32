"""IoU-matched agreement of two detectors' answers (bitserve/rollout/compare.py)."""

import numpy as np
import pytest

from bitserve.rollout.compare import compare_outputs


def _answer(boxes, classes, k=4):
    out_boxes = np.zeros((1, k, 4), np.float32)
    out_classes = np.full((1, k), -1, np.int32)
    out_boxes[0, : len(boxes)] = np.reshape(boxes, (-1, 4))
    out_classes[0, : len(classes)] = classes
    scores = np.where(out_classes >= 0, 0.9, 0.0).astype(np.float32)
    count = np.array([[len(boxes)]], np.int32)
    return {"boxes": out_boxes, "scores": scores, "classes": out_classes, "num_detections": count}


A = [[0, 0, 10, 10], [20, 20, 40, 40]]


def test_the_same_boxes_in_another_order_agree_fully():
    figures = compare_outputs(_answer(A, [1, 2]), _answer(A[::-1], [2, 1]), {})
    assert figures == {"boxes": {"box_agreement": 1.0, "mean_iou": 1.0}}  # no slot-wise parts


def test_a_slightly_moved_box_still_matches_with_its_iou():
    moved = [[1, 0, 11, 10], [20, 20, 40, 40]]
    figures = compare_outputs(_answer(A, [1, 2]), _answer(moved, [1, 2]), {})["boxes"]
    assert figures["box_agreement"] == 1.0
    assert figures["mean_iou"] == pytest.approx((9 / 11 + 1) / 2)


def test_a_missed_box_a_wrong_class_and_a_far_box_disagree():
    assert compare_outputs(_answer(A, [1, 2]), _answer(A[:1], [1]), {})["boxes"][
        "box_agreement"
    ] == pytest.approx(2 / 3)
    wrong = compare_outputs(_answer(A, [1, 2]), _answer(A, [1, 3]), {})["boxes"]
    assert wrong["box_agreement"] == pytest.approx(0.5)
    far = compare_outputs(_answer(A[:1], [1]), _answer([[5, 5, 15, 15]], [1]), {})["boxes"]
    assert far["box_agreement"] == 0.0  # IoU 25/175 < 0.5


def test_two_empty_answers_agree():
    assert compare_outputs(_answer([], []), _answer([], []), {})["boxes"]["box_agreement"] == 1.0


def test_other_outputs_keep_their_comparison():
    figures = compare_outputs({"y": np.ones((1, 3))}, {"y": np.ones((1, 3))}, {})
    assert figures["y"]["cosine"] == pytest.approx(1.0)


def test_a_box_output_declared_under_another_name_keeps_its_agreement():
    def renamed(answer):
        return {("bbox" if k == "boxes" else k): v for k, v in answer.items()}

    a, b = renamed(_answer(A, [1, 2])), renamed(_answer(A[::-1], [2, 1]))
    figures = compare_outputs(a, b, {"bbox": "boxes"})
    assert figures == {"bbox": {"box_agreement": 1.0, "mean_iou": 1.0}}
