"""The synthetic set: seeded, boxes on the ink, COCO ground truth pycocotools accepts."""

import numpy as np

from bitserve.vision import data


def test_heldout_is_the_same_set_every_time():
    a, b = data.heldout(5), data.heldout(5)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.image, y.image)
        assert np.array_equal(x.boxes, y.boxes)


def test_heldout_digits_are_not_training_digits():
    pools = data.pools()
    train = {img.tobytes() for img in pools.train_images}
    assert not any(img.tobytes() in train for img in pools.heldout_images[:50])


def test_boxes_lie_on_the_canvas_and_hold_ink():
    for canvas in data.heldout(20):
        assert canvas.image.shape == (128, 128) and canvas.image.dtype == np.uint8
        assert 1 <= len(canvas.boxes) <= 5
        for x, y, w, h in canvas.boxes.astype(int):
            assert x >= 0 and y >= 0 and x + w <= 128 and y + h <= 128
            assert canvas.image[y : y + h, x : x + w].max() > 150  # a digit's ink is bright


def test_coco_ground_truth_loads_in_pycocotools():
    from pycocotools.coco import COCO

    canvases = data.heldout(10)
    coco = COCO()
    coco.dataset = data.to_coco(canvases)
    coco.createIndex()
    assert len(coco.getImgIds()) == 10
    assert len(coco.getAnnIds()) == sum(len(c.boxes) for c in canvases)
    assert sorted(coco.getCatIds()) == list(range(10))


def test_mnist_held_out_set_is_fixed_and_from_the_test_split():
    m = data.mnist()
    assert m.train_images.shape == (50_000, 28, 28) and m.heldout_images.shape == (10_000, 28, 28)
    a, b = data.heldout_mnist(20), data.heldout_mnist(20)
    assert all(np.array_equal(x.image, y.image) for x, y in zip(a, b, strict=True))
    for canvas in a:
        x, y, w, h = canvas.boxes.T
        assert np.all((x >= 0) & (y >= 0) & (x + w <= data.CANVAS) & (y + h <= data.CANVAS))
        assert np.all((w >= 2) & (h >= 8)) and set(canvas.labels) <= set(range(10))


def test_training_canvases_mix_both_digit_sources():
    """A 28x28 scan is cropped to its ink, so both sources give digits of the drawn size."""
    rng = np.random.default_rng(0)
    canvases = data.training_batch(rng, 16)
    heights = np.concatenate([c.boxes[:, 3] for c in canvases])
    assert heights.min() >= 6 and heights.max() <= 48
