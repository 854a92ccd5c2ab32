"""A user's validation set in COCO format: a folder with images and one instances_*.json.

`load` checks the file before anything uses it, and says which field is wrong: each
image needs an integer `id`, a `file_name` that exists (beside the JSON, in `images/`
or in the split's folder, `val2017/` for instances_val2017.json), and positive `width`
and `height`; each annotation an `image_id` and `category_id` that exist and a `bbox`
of four numbers with width and height >= 0. `mean_ap` scores detections with
pycocotools' COCOeval on this set (mAP@[.5:.95] and mAP@.5).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

import numpy as np


class CocoError(ValueError):
    """A malformed COCO folder; the message names the file and the field."""


@dataclass
class CocoSet:
    file: Path
    dataset: dict
    paths: dict[int, Path]  # image id -> file
    category_ids: list[int]  # sorted: class index i is category_ids[i] unless declared

    @property
    def image_ids(self) -> list[int]:
        return sorted(self.paths)

    def image(self, image_id: int) -> np.ndarray:
        """uint8 [H, W, 3] RGB (any file PIL reads)."""
        from PIL import Image

        with Image.open(self.paths[image_id]) as pil:
            return np.asarray(pil.convert("RGB"))


def load(folder: Path) -> CocoSet:
    folder = Path(folder)
    found = sorted(folder.glob("instances_*.json")) + sorted(
        folder.glob("annotations/instances_*.json")
    )
    if len(found) != 1:
        what = "no instances_*.json" if not found else f"{len(found)} instances_*.json files"
        raise CocoError(f"{folder}: {what}; a COCO folder holds exactly one")
    file = found[0]
    try:
        dataset = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CocoError(f"{file}: not a JSON file ({e})") from None
    if not isinstance(dataset, dict):
        raise CocoError(f"{file}: the top level is {type(dataset).__name__}, not an object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(dataset.get(key), list):
            raise CocoError(f"{file}: field '{key}': missing or not a list")
    if not dataset["images"]:
        raise CocoError(f"{file}: field 'images': empty")
    split = file.stem.removeprefix("instances_")
    places = [file.parent, file.parent / "images", file.parent / split]
    places += [folder, folder / "images", folder / split]
    paths, sizes = {}, {}
    for i, image in enumerate(dataset["images"]):
        where = f"{file}: field 'images[{i}]"
        if not isinstance(image, dict):
            raise CocoError(f"{where}': not an object")
        if not _int(image.get("id")):
            raise CocoError(f"{where}.id': {image.get('id')!r} is not an integer")
        for key in ("width", "height"):
            if not _int(image.get(key)) or image[key] <= 0:
                raise CocoError(f"{where}.{key}': {image.get(key)!r} is not a positive integer")
        name = image.get("file_name")
        if not isinstance(name, str):
            raise CocoError(f"{where}.file_name': {name!r} is not a file name")
        path = next((p / name for p in places if (p / name).is_file()), None)
        if path is None:
            raise CocoError(f"{where}.file_name': {name} not found under {folder}")
        paths[image["id"]] = path
        sizes[image["id"]] = (image["height"], image["width"])
    categories = set()
    for i, category in enumerate(dataset["categories"]):
        if not isinstance(category, dict) or not _int(category.get("id")):
            raise CocoError(f"{file}: field 'categories[{i}].id': not an integer")
        categories.add(category["id"])
    for i, ann in enumerate(dataset["annotations"]):
        where = f"{file}: field 'annotations[{i}]"
        if not isinstance(ann, dict):
            raise CocoError(f"{where}': not an object")
        if ann.get("image_id") not in paths:
            raise CocoError(f"{where}.image_id': {ann.get('image_id')!r} is no image's id")
        if ann.get("category_id") not in categories:
            raise CocoError(f"{where}.category_id': {ann.get('category_id')!r} is no category")
        box = ann.get("bbox")
        if not (
            isinstance(box, list)
            and len(box) == 4
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in box)
            and box[2] >= 0
            and box[3] >= 0
        ):
            raise CocoError(f"{where}.bbox': {box!r} is not [x, y, width, height] (>= 0)")
        if not _int(ann.get("id")):
            raise CocoError(f"{where}.id': {ann.get('id')!r} is not an integer")
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", float(box[2] * box[3]))
    return CocoSet(file, dataset, paths, sorted(categories))


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def mean_ap(coco: CocoSet, detections: dict[int, tuple], category_ids) -> dict[str, float]:
    """detections: image id -> (boxes xyxy [K, 4] in the image's pixels, scores, classes
    as indices into `category_ids`) -> {"map": mAP@[.5:.95], "map50": mAP@.5}."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    results = []
    for image_id, (boxes, scores, classes) in detections.items():
        for (x1, y1, x2, y2), score, label in zip(boxes, scores, classes, strict=True):
            if score <= 0.001 or not 0 <= label < len(category_ids):
                continue
            results.append(
                {
                    "image_id": image_id,
                    "category_id": int(category_ids[int(label)]),
                    "bbox": [float(x1), float(y1), float(x2 - x1), float(y2 - y1)],
                    "score": float(score),
                }
            )
    if not results:
        return {"map": 0.0, "map50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        truth = COCO()
        truth.dataset = coco.dataset
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.params.imgIds = sorted(detections)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return {"map": float(evaluation.stats[0]), "map50": float(evaluation.stats[1])}


def write(folder: Path, images, boxes, labels, split: str = "val", classes: int = 10) -> Path:
    """A COCO folder from arrays (images uint8, COCO boxes [n, 4], labels [n]): PNG files
    in `<split>/` and `instances_<split>.json` beside them. For tests and the bench."""
    from PIL import Image

    folder = Path(folder)
    (folder / split).mkdir(parents=True, exist_ok=True)
    doc = {"images": [], "annotations": [], "categories": []}
    for image_id, (image, b, lab) in enumerate(zip(images, boxes, labels, strict=True), 1):
        name = f"{image_id:06d}.png"
        Image.fromarray(image).save(folder / split / name)
        h, w = image.shape[:2]
        doc["images"].append({"id": image_id, "file_name": name, "width": w, "height": h})
        for box, label in zip(np.asarray(b).tolist(), np.asarray(lab).tolist(), strict=True):
            doc["annotations"].append(
                {
                    "id": len(doc["annotations"]) + 1,
                    "image_id": image_id,
                    "category_id": int(label),
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
    doc["categories"] = [{"id": c, "name": str(c)} for c in range(classes)]
    path = folder / f"instances_{split}.json"
    path.write_text(json.dumps(doc))
    return path
