"""The synthetic detection set: 1-5 handwritten digits on a cluttered 128x128 canvas.

Digits come from scikit-learn's bundled 8x8 digits (1,797 images, nothing downloads),
split once by a fixed seed into a training pool and a held-out pool, so that the
held-out images show digits the model never saw. Each digit is upscaled to a random
size, pasted at a random place (overlapping earlier digits by at most a little), and
the canvas gets clutter: noise, strokes and blobs that are not digits. Everything is
a function of the seed, so `heldout(500)` is the same set on every machine.

Boxes are COCO's [x, y, width, height] in pixels, tight around the digit's ink.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.ndimage import zoom

CANVAS = 128
NUM_CLASSES = 10
HELDOUT_SEED = 20_261_201


@dataclass(frozen=True)
class Pools:
    """Digit images (float 0..1, 8x8) and labels for training and held-out canvases."""

    train_images: np.ndarray
    train_labels: np.ndarray
    heldout_images: np.ndarray
    heldout_labels: np.ndarray


@functools.cache
def pools() -> Pools:
    table = _digits_table()
    order = np.random.default_rng(0).permutation(len(table))
    images = (table[:, :64].reshape(-1, 8, 8) / 16.0).astype(np.float32)[order]
    labels = table[:, 64].astype(np.int64)[order]
    cut = int(0.8 * len(labels))
    return Pools(images[:cut], labels[:cut], images[cut:], labels[cut:])


def _digits_table() -> np.ndarray:
    """scikit-learn's bundled digits.csv.gz (what `load_digits` reads: 64 pixels 0..16
    and the label per row), read directly: importing sklearn costs seconds."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the synthetic detection set needs scikit-learn (the vision extra)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    return np.loadtxt(path, delimiter=",", dtype=np.float32)


@dataclass
class Canvas:
    image: np.ndarray  # uint8 [CANVAS, CANVAS]
    boxes: np.ndarray  # float32 [n, 4], COCO x, y, w, h
    labels: np.ndarray  # int64 [n]


def make_canvas(
    rng: np.random.Generator, images: np.ndarray, labels: np.ndarray, sizes=(14, 44)
) -> Canvas:
    canvas = _clutter(rng)
    boxes: list[list[float]] = []
    classes: list[int] = []
    for _ in range(rng.integers(1, 6)):
        index = rng.integers(len(labels))
        box = _paste(rng, canvas, images[index], int(rng.integers(*sizes)), boxes)
        if box is not None:
            boxes.append(box)
            classes.append(int(labels[index]))
    image = (np.clip(canvas, 0, 1) * 255).astype(np.uint8)
    return Canvas(image, np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int64))


def _clutter(rng: np.random.Generator) -> np.ndarray:
    canvas = rng.uniform(0, 0.15, (CANVAS, CANVAS)).astype(np.float32)
    for _ in range(rng.integers(2, 7)):  # strokes: straight lines of random ink
        x0, y0, x1, y1 = rng.uniform(0, CANVAS, 4)
        steps = np.linspace(0, 1, 200)
        xs = np.clip((x0 + (x1 - x0) * steps).astype(int), 0, CANVAS - 1)
        ys = np.clip((y0 + (y1 - y0) * steps).astype(int), 0, CANVAS - 1)
        canvas[ys, xs] = np.maximum(canvas[ys, xs], rng.uniform(0.3, 0.8))
    for _ in range(rng.integers(1, 4)):  # blobs: soft filled ellipses
        cx, cy = rng.integers(8, CANVAS - 8, 2)
        rx, ry = rng.uniform(2, 7, 2)
        yy, xx = np.ogrid[-8:8, -8:8]
        inside = (xx / rx) ** 2 + (yy / ry) ** 2 <= 1
        region = canvas[cy - 8 : cy + 8, cx - 8 : cx + 8]
        region[inside] = np.maximum(region[inside], rng.uniform(0.2, 0.6))
    return canvas


def _paste(rng, canvas, digit, size, placed) -> list[float] | None:
    patch = np.clip(zoom(digit, size / 8.0, order=1), 0, 1) * rng.uniform(0.7, 1.0)
    ink = np.argwhere(patch > 0.25)
    if len(ink) == 0:
        return None
    (r0, c0), (r1, c1) = ink.min(0), ink.max(0) + 1
    h, w = patch.shape
    for _ in range(20):  # a place that overlaps earlier digits by little
        x, y = (int(v) for v in rng.integers(0, CANVAS - np.array([w, h]) + 1))
        box = [float(x + c0), float(y + r0), float(c1 - c0), float(r1 - r0)]
        if all(_iou(box, other) < 0.1 for other in placed):
            region = canvas[y : y + h, x : x + w]
            np.maximum(region, patch, out=region)
            return box
    return None


def _iou(a, b) -> float:
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def training_batch(rng: np.random.Generator, count: int) -> list[Canvas]:
    p = pools()
    return [make_canvas(rng, p.train_images, p.train_labels) for _ in range(count)]


def heldout(count: int = 500) -> list[Canvas]:
    """The held-out set: digits from the held-out pool, sizes 16-40 px, a fixed seed."""
    p = pools()
    rng = np.random.default_rng(HELDOUT_SEED)
    return [
        make_canvas(rng, p.heldout_images, p.heldout_labels, sizes=(16, 41)) for _ in range(count)
    ]


def to_coco(canvases: list[Canvas]) -> dict:
    """COCO ground truth (images, annotations, categories) for pycocotools."""
    images, annotations = [], []
    for image_id, canvas in enumerate(canvases, start=1):
        h, w = canvas.image.shape[:2]
        images.append({"id": image_id, "width": w, "height": h})
        for box, label in zip(canvas.boxes.tolist(), canvas.labels.tolist(), strict=True):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": label,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    categories = [{"id": c, "name": str(c)} for c in range(NUM_CLASSES)]
    return {"images": images, "annotations": annotations, "categories": categories}
