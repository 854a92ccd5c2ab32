"""The `detector` backend: an exported detector graph (`<version>/model.onnx`) behind v2.

Inputs: `image` UINT8 [H, W, C] (C = 1 or 3; a batch is [N, H, W, C]), and optionally
`score_threshold` FP32 [1] and `max_detections` INT32 [1] per request (defaults in the
config's parameters). Outputs per request: `boxes` FP32 [K, 4] (x1, y1, x2, y2 in the
image's pixels), `scores` FP32 [K], `classes` INT32 [K] and `num_detections` INT32 [1].
The first `num_detections` rows are detections, best first; the rest (score 0, class
-1) pad a batch to one K, which is the largest `max_detections` among its requests
(so a request alone, or batched with requests like it, gets exactly its own K).

Every variant `bitserve optimize` writes (int8, pruned, student, another resolution)
is the same kind of graph, so each serves through this backend with the same outputs.
A detector exported elsewhere serves here too when the config declares it
(`[parameters.preprocess]` and `[parameters.outputs]`, bitserve/vision/graph.py): the
backend then resizes, decodes and maps boxes back itself, and a version's
`variant.json` (written by `bitserve optimize --data`) sets that version's input size
and onnxruntime optimisation level.
`validate` refuses what would fail or exhaust a batch: an empty image, one larger
than `parameters.max_image_pixels`, a channel count other than 1 or 3, a threshold
outside 0..1, a `max_detections` outside 1..100.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bitserve.backends.base import LoadError, Model
from bitserve.config import ModelConfig

DEFAULTS = {"score_threshold": 0.3, "max_detections": 20, "max_image_pixels": 4096 * 4096}
TOP_K = 100  # the graph's top-K (bitserve.vision.net.TOP_K)


def _setting(config: ModelConfig, key: str) -> Any:
    return config.parameters.get(key, DEFAULTS[key])


class DetectorModel(Model):
    platform = "bitserve_detector"

    def load(self) -> None:
        import onnxruntime as ort

        from bitserve.backends.onnx import open_session

        path = self.require_file("model.onnx")
        options = ort.SessionOptions()
        if self.config.instance_group.threads > 0:
            options.intra_op_num_threads = self.config.instance_group.threads
            options.inter_op_num_threads = 1
        self.graph = None
        parameters = dict(self.config.parameters)
        if "outputs" in parameters:
            parameters = self._variant(parameters, options)
        try:
            self.session = open_session(path, options, self.config, self.device)
        except Exception as e:
            raise LoadError(f"{path}: onnxruntime cannot load it: {type(e).__name__}: {e}") from e
        if "outputs" in parameters:
            from bitserve.vision.graph import Detector, GraphError

            try:
                self.graph = Detector.from_config(path, parameters, "config.toml", self.session)
            except GraphError as e:
                raise LoadError(str(e)) from e
            return
        names = [o.name for o in self.session.get_outputs()]
        if [i.name for i in self.session.get_inputs()] != ["image"] or names[:3] != [
            "boxes",
            "scores",
            "classes",
        ]:
            raise LoadError(f"{path}: not a detector graph (image -> boxes, scores, classes)")

    def _variant(self, parameters: dict, options) -> dict:
        """This version's variant.json: its input size and optimisation level."""
        import json

        import onnxruntime as ort

        path = self.version_dir / "variant.json"
        if not path.is_file():
            return parameters
        variant = json.loads(path.read_text())
        size = variant.get("preprocess", {}).get("size")
        if size:
            parameters["preprocess"] = dict(parameters.get("preprocess", {}), size=size)
        level = variant.get("session", {}).get("graph_optimization_level")
        levels = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        if level in levels:
            options.graph_optimization_level = levels[level]
        return parameters

    @classmethod
    def validate(cls, config: ModelConfig, inputs: dict[str, np.ndarray]) -> None:
        image = inputs.get("image")
        if image is None:
            raise ValueError("input 'image' is missing")
        if image.ndim != 4:
            raise ValueError(f"input 'image': shape {list(image.shape)} is not [N, H, W, C]")
        _, height, width, channels = image.shape
        if height == 0 or width == 0:
            raise ValueError(f"input 'image': zero-size image {height}x{width}")
        if channels not in (1, 3):
            raise ValueError(f"input 'image': {channels} channels; expected 1 (grey) or 3 (RGB)")
        limit = int(_setting(config, "max_image_pixels"))
        if height * width > limit:
            raise ValueError(
                f"input 'image': {height}x{width} is {height * width} pixels, over this "
                f"model's limit of {limit} (parameters.max_image_pixels)"
            )
        threshold = inputs.get("score_threshold")
        if threshold is not None and not np.all((threshold >= 0) & (threshold <= 1)):
            raise ValueError("input 'score_threshold': must lie in 0..1")
        cap = inputs.get("max_detections")
        if cap is not None and not np.all((cap >= 1) & (cap <= TOP_K)):
            raise ValueError(f"input 'max_detections': must lie in 1..{TOP_K}")

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        image = np.ascontiguousarray(inputs["image"])
        if self.graph is not None:
            boxes, scores, classes = _padded(self.graph(list(image)))
        else:
            boxes, scores, classes = self.session.run(None, {"image": image})[:3]
        rows = image.shape[0]
        thresholds = self._per_row(inputs, "score_threshold", rows, np.float32)
        caps = self._per_row(inputs, "max_detections", rows, np.int64)
        return select(boxes, scores, classes, thresholds, caps, image.shape[1:3])

    def _per_row(self, inputs, name: str, rows: int, dtype) -> np.ndarray:
        given = inputs.get(name)
        if given is None:
            return np.full(rows, _setting(self.config, name), dtype)
        return given.reshape(rows, -1)[:, 0].astype(dtype)


def _padded(found: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-image detections (best first) as one batch padded to TOP_K (score 0)."""
    boxes = np.zeros((len(found), TOP_K, 4), np.float32)
    scores = np.zeros((len(found), TOP_K), np.float32)
    classes = np.full((len(found), TOP_K), -1, np.int64)
    for row, (b, s, c) in enumerate(found):
        k = min(len(s), TOP_K)
        boxes[row, :k], scores[row, :k], classes[row, :k] = b[:k], s[:k], c[:k]
    return boxes, scores, classes


def select(boxes, scores, classes, thresholds, caps, size) -> dict[str, np.ndarray]:
    """Keep each row's detections above its threshold, at most its cap, boxes clipped to
    the image; pad every row to the batch's largest cap."""
    rows, width = len(scores), int(caps.max())
    keep = (scores >= thresholds[:, None]) & (np.arange(scores.shape[1]) < caps[:, None])
    keep = keep[:, :width]  # top-K comes sorted, so kept rows are a prefix
    height, image_width = size
    limits = np.array([image_width, height, image_width, height], np.float32)
    out_boxes = np.where(keep[..., None], np.clip(boxes[:, :width], 0, limits), 0)
    return {
        "boxes": out_boxes.astype(np.float32),
        "scores": np.where(keep, scores[:, :width], 0).astype(np.float32),
        "classes": np.where(keep, classes[:, :width], -1).astype(np.int32),
        "num_detections": keep.sum(axis=1, dtype=np.int32).reshape(rows, 1),
    }


BACKEND = DetectorModel
