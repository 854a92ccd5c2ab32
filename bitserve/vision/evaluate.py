"""mAP on the held-out set with pycocotools' COCOeval (not a hand-written AP).

`detect` is any callable from a uint8 batch [N, H, W] to the graph's outputs (boxes
x1, y1, x2, y2; scores; classes), so a torch network, an onnxruntime session and a
quantized graph are scored by the same code.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import numpy as np

from bitserve.vision import data

Detect = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def session_detect(session) -> Detect:
    """An onnxruntime session over an exported detector as a `Detect`."""
    return lambda images: tuple(session.run(None, {"image": images[..., None]}))


def coco_results(detect: Detect, canvases: list[data.Canvas], batch: int = 32) -> list[dict]:
    results = []
    for start in range(0, len(canvases), batch):
        chunk = canvases[start : start + batch]
        boxes, scores, classes = detect(np.stack([c.image for c in chunk]))
        for row in range(len(chunk)):
            for box, score, label in zip(boxes[row], scores[row], classes[row], strict=True):
                if score <= 0.001:
                    continue
                x1, y1, x2, y2 = (float(v) for v in box)
                results.append(
                    {
                        "image_id": start + row + 1,
                        "category_id": int(label),
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "score": float(score),
                    }
                )
    return results


def mean_ap(detect: Detect, canvases: list[data.Canvas]) -> dict[str, float]:
    """{"map": mAP@[.5:.95], "map50": mAP@.5} on `canvases`, from COCOeval."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    results = coco_results(detect, canvases)
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        truth = COCO()
        truth.dataset = data.to_coco(canvases)
        truth.createIndex()
        if not results:
            return {"map": 0.0, "map50": 0.0}
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return {"map": float(evaluation.stats[0]), "map50": float(evaluation.stats[1])}
