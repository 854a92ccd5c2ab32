"""A detector someone else exported to ONNX, as its config declares it.

The graph's own conventions are never guessed: `[parameters.preprocess]` says how an
image becomes its input (size, `stretch` or `letterbox` resize, channel order, layout,
scale, mean/std, dtype) and `[parameters.outputs]` says how its outputs become boxes:

- `decoder = "none"`: a post-NMS graph; `boxes`, `scores`, `classes` name its outputs
  ([N, K, 4], [N, K], [N, K]), `box_format` is xyxy, xywh or cxcywh, in input pixels
  (`normalized = true`: in 0..1 of the input).
- `decoder = "yolo"`: raw heads, one output `output` [N, A, 4 + C] (cx, cy, w, h in input
  pixels, then the per-class scores; `channels_first = true` for [N, 4 + C, A], as
  YOLOv8 exports); the best class per anchor, then class-wise NMS at `iou_threshold`.
- `decoder = "centernet"`: `heatmap` logits [N, C, h, w] and `regression` [N, 4, h, w]
  (width, height in cells, x, y offset in the cell) at `stride`; 3x3 peaks, top K.

`Detector` runs the whole path (preprocess, session, decode, boxes back into each
image's own pixels); `bitserve optimize --data` and the `detector` backend use it.
Every mistake in the declaration is a `GraphError` naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

TOP_K = 100


class GraphError(ValueError):
    """A declaration that does not fit the graph: the message names file and field."""


@dataclass(frozen=True)
class Preprocess:
    size: tuple[int, int]  # the graph's input height, width
    resize: str = "letterbox"  # or "stretch"
    pad_value: int = 114
    channels: str = "rgb"  # "rgb", "bgr" or "grey"
    layout: str = "nchw"  # or "nhwc"
    scale: float = 255.0  # pixel / scale, then (x - mean) / std
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    dtype: str = "float32"  # or "uint8" (no scaling)

    @classmethod
    def parse(cls, raw: dict, where: str) -> Preprocess:
        choices = {
            "resize": ("letterbox", "stretch"),
            "channels": ("rgb", "bgr", "grey"),
            "layout": ("nchw", "nhwc"),
            "dtype": ("float32", "uint8"),
        }
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise GraphError(f"{where}: parameters.preprocess.{sorted(unknown)[0]}: unknown field")
        if "size" not in raw:
            raise GraphError(f"{where}: parameters.preprocess.size: missing ([height, width])")
        size = raw["size"]
        if not (
            isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size)
        ):
            raise GraphError(
                f"{where}: parameters.preprocess.size: {size!r} is not [height, width]"
            )
        for key, allowed in choices.items():
            if key in raw and raw[key] not in allowed:
                raise GraphError(
                    f"{where}: parameters.preprocess.{key}: {raw[key]!r} is not one of {allowed}"
                )
        fields = dict(raw, size=tuple(size))
        for key in ("mean", "std"):
            if key in fields:
                fields[key] = tuple(float(v) for v in fields[key])
        return cls(**fields)

    @property
    def depth(self) -> int:
        return 1 if self.channels == "grey" else 3

    def __call__(self, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images [H, W] or [H, W, C] (C = 1 or 3, RGB) -> the graph's input batch,
        and per image (scale x, scale y, pad x, pad y) to map boxes back."""
        from PIL import Image

        height, width = self.size
        batch = np.full((len(images), height, width, self.depth), self.pad_value, np.uint8)
        maps = np.zeros((len(images), 4), np.float32)
        for row, image in enumerate(images):
            image = _channels(image, self.channels)
            h, w = image.shape[:2]
            if self.resize == "stretch":
                sx, sy, new_w, new_h = width / w, height / h, width, height
            else:
                sx = sy = min(width / w, height / h)
                new_w, new_h = max(1, round(w * sx)), max(1, round(h * sy))
            px, py = (width - new_w) // 2, (height - new_h) // 2
            mode = "L" if self.depth == 1 else "RGB"
            pil = Image.fromarray(image[..., 0] if self.depth == 1 else image, mode)
            resized = np.asarray(pil.resize((new_w, new_h), Image.BILINEAR))
            batch[row, py : py + new_h, px : px + new_w] = resized.reshape(new_h, new_w, -1)
            maps[row] = (sx, sy, px, py)
        x = batch
        if self.dtype == "float32":
            x = batch.astype(np.float32) / self.scale
            x = (x - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
        if self.layout == "nchw":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x), maps


def _channels(image: np.ndarray, channels: str) -> np.ndarray:
    if image.ndim == 2:
        image = image[..., None]
    if channels == "grey":
        if image.shape[2] == 3:  # ITU-R 601 luma, as PIL's "L"
            luma = image.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
            return np.round(luma).astype(np.uint8)[..., None]
        return image
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    return image[..., ::-1] if channels == "bgr" else image


@dataclass(frozen=True)
class Outputs:
    decoder: str  # "none", "yolo" or "centernet"
    names: dict[str, str]  # role -> graph output name
    box_format: str = "xyxy"
    normalized: bool = False
    channels_first: bool = False
    iou_threshold: float = 0.5
    stride: int = 4
    category_ids: tuple[int, ...] | None = None  # class index -> COCO category id

    ROLES: ClassVar = {
        "none": ("boxes", "scores", "classes"),
        "yolo": ("output",),
        "centernet": ("heatmap", "regression"),
    }

    @classmethod
    def parse(cls, raw: dict, where: str) -> Outputs:
        decoder = raw.get("decoder")
        if decoder not in cls.ROLES:
            raise GraphError(
                f"{where}: parameters.outputs.decoder: {decoder!r} is not one of {tuple(cls.ROLES)}"
            )
        names = {}
        for role in cls.ROLES[decoder]:
            if not isinstance(raw.get(role), str):
                raise GraphError(
                    f"{where}: parameters.outputs.{role}: missing (the graph output that "
                    f"holds the {role} for decoder {decoder!r})"
                )
            names[role] = raw[role]
        if raw.get("box_format", "xyxy") not in ("xyxy", "xywh", "cxcywh"):
            raise GraphError(
                f"{where}: parameters.outputs.box_format: {raw['box_format']!r} is not one of "
                "('xyxy', 'xywh', 'cxcywh')"
            )
        known = {"decoder", "box_format", "normalized", "channels_first", "iou_threshold"}
        known |= {"stride", "category_ids", *cls.ROLES[decoder]}
        unknown = set(raw) - known
        if unknown:
            raise GraphError(f"{where}: parameters.outputs.{sorted(unknown)[0]}: unknown field")
        ids = raw.get("category_ids")
        return cls(
            decoder,
            names,
            raw.get("box_format", "xyxy"),
            bool(raw.get("normalized", False)),
            bool(raw.get("channels_first", False)),
            float(raw.get("iou_threshold", 0.5)),
            int(raw.get("stride", 4)),
            tuple(int(v) for v in ids) if ids is not None else None,
        )

    def decode(self, outputs: dict[str, np.ndarray], size: tuple[int, int]) -> list[tuple]:
        """The graph's outputs for a batch -> per image (boxes xyxy in input pixels [K, 4],
        scores [K], classes [K]), best first, K <= TOP_K."""
        if self.decoder == "yolo":
            return [self._yolo(row) for row in outputs[self.names["output"]]]
        if self.decoder == "centernet":
            heat, reg = outputs[self.names["heatmap"]], outputs[self.names["regression"]]
            return [self._centernet(h, r) for h, r in zip(heat, reg, strict=True)]
        boxes, scores, classes = (outputs[self.names[k]] for k in self.ROLES["none"])
        out = []
        for b, s, c in zip(boxes, scores, classes, strict=True):
            b = _xyxy(np.asarray(b, np.float32), self.box_format)
            if self.normalized:
                b = b * np.array([size[1], size[0], size[1], size[0]], np.float32)
            order = np.argsort(-s, kind="stable")[:TOP_K]
            out.append((b[order], s[order].astype(np.float32), c[order].astype(np.int64)))
        return out

    def _yolo(self, rows: np.ndarray) -> tuple:
        rows = rows.T if self.channels_first else rows
        classes = rows[:, 4:].argmax(1)
        scores = rows[np.arange(len(rows)), 4 + classes]
        keep = np.argsort(-scores, kind="stable")[:1000]
        keep = keep[scores[keep] > 0.001]
        boxes = _xyxy(rows[keep, :4].astype(np.float32), "cxcywh")
        chosen = nms(boxes, scores[keep], classes[keep], self.iou_threshold)[:TOP_K]
        return boxes[chosen], scores[keep][chosen].astype(np.float32), classes[keep][chosen]

    def _centernet(self, heat: np.ndarray, reg: np.ndarray) -> tuple:
        from scipy.ndimage import maximum_filter

        prob = 1 / (1 + np.exp(-heat.astype(np.float32)))
        peaks = prob * (maximum_filter(prob, size=(1, 3, 3), mode="constant") == prob)
        _, h, w = peaks.shape
        flat = peaks.reshape(-1)
        top = np.argsort(-flat, kind="stable")[:TOP_K]
        classes, cell = top // (h * w), top % (h * w)
        ys, xs = cell // w, cell % w
        rw, rh, dx, dy = reg.reshape(4, h * w)[:, cell]
        cx, cy = (xs + dx) * self.stride, (ys + dy) * self.stride
        boxes = np.stack([cx, cy, rw * self.stride, rh * self.stride], 1).astype(np.float32)
        return _xyxy(boxes, "cxcywh"), flat[top].astype(np.float32), classes


def _xyxy(boxes: np.ndarray, form: str) -> np.ndarray:
    if form == "xyxy":
        return boxes
    if form == "xywh":
        return np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], 1)
    half = boxes[:, 2:] / 2
    return np.concatenate([boxes[:, :2] - half, boxes[:, :2] + half], 1)


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float) -> np.ndarray:
    """Class-wise greedy non-maximum suppression; the kept indices, best first."""
    shifted = boxes + (classes[:, None] * (boxes.max() + 1.0))  # classes never overlap
    area = (shifted[:, 2] - shifted[:, 0]).clip(0) * (shifted[:, 3] - shifted[:, 1]).clip(0)
    order, keep = np.argsort(-scores, kind="stable"), []
    while len(order):
        best, rest = order[0], order[1:]
        keep.append(best)
        lo = np.maximum(shifted[best, :2], shifted[rest, :2])
        hi = np.minimum(shifted[best, 2:], shifted[rest, 2:])
        inter = (hi - lo).clip(0).prod(1)
        overlap = inter / (area[best] + area[rest] - inter + 1e-9)
        order = rest[overlap <= iou]
    return np.array(keep, np.int64)


class Detector:
    """One ONNX detector graph with its declared preprocessing and decoding."""

    def __init__(self, path: Path, preprocess: Preprocess, outputs: Outputs, session=None):
        self.path, self.preprocess, self.outputs = Path(path), preprocess, outputs
        self.session = session or open_session(path)
        self.input = self.session.get_inputs()[0].name
        self.check()

    @classmethod
    def from_config(cls, path: Path, parameters: dict, where: str, session=None) -> Detector:
        for table in ("preprocess", "outputs"):
            if not isinstance(parameters.get(table), dict):
                raise GraphError(f"{where}: parameters.{table}: missing (a table declaring it)")
        preprocess = Preprocess.parse(parameters["preprocess"], where)
        return cls(path, preprocess, Outputs.parse(parameters["outputs"], where), session)

    def check(self) -> None:
        """The declared outputs exist and decode: one blank image through the graph."""
        names = [o.name for o in self.session.get_outputs()]
        for role, name in self.outputs.names.items():
            if name not in names:
                raise GraphError(
                    f"{self.path}: parameters.outputs.{role}: {name!r} is not an output of "
                    f"the graph (its outputs: {names})"
                )
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise GraphError(f"{self.path}: inputs: {len(inputs)} inputs; a detector takes one")
        blank = np.zeros((*self.preprocess.size, 3), np.uint8)
        try:
            raw = self.raw(self.preprocess([blank])[0])
        except Exception as e:
            raise GraphError(
                f"{self.path}: parameters.preprocess: the graph refuses the declared input "
                f"({type(e).__name__}: {e})"
            ) from e
        for role, name in self.outputs.names.items():
            shape = raw[name].shape
            want = {"boxes": 3, "scores": 2, "classes": 2, "output": 3, "heatmap": 4}
            want["regression"] = 4
            bad = len(shape) != want[role]
            bad |= role == "output" and (shape[1 if self.outputs.channels_first else 2] < 5)
            bad |= role == "boxes" and shape[-1] != 4
            bad |= role == "regression" and shape[1] != 4
            if bad:
                raise GraphError(
                    f"{self.path}: parameters.outputs.{role}: output {name!r} has shape "
                    f"{list(shape)}, which decoder {self.outputs.decoder!r} cannot read"
                )

    def raw(self, x: np.ndarray) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(None, {self.input: x}), strict=True))

    def __call__(self, images: list[np.ndarray]) -> list[tuple]:
        """uint8 images -> per image (boxes xyxy in its own pixels, scores, classes)."""
        x, maps = self.preprocess(images)
        decoded = self.outputs.decode(self.raw(x), self.preprocess.size)
        out = []
        for (boxes, scores, classes), (sx, sy, px, py), image in zip(
            decoded, maps, images, strict=True
        ):
            h, w = image.shape[:2]
            boxes = (boxes - np.array([px, py, px, py], np.float32)) / np.array(
                [sx, sy, sx, sy], np.float32
            )
            boxes = np.clip(boxes, 0, np.array([w, h, w, h], np.float32))
            out.append((boxes, scores, classes))
        return out


def open_session(path: Path, threads: int = 1, level: str = "all"):
    import onnxruntime as ort

    levels = {
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = levels[level]
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
