"""A second, different detector for `bitserve optimize --data`: a small YOLO-style network
(anchor-free, one stride-8 head that predicts per cell the box's centre offset and
log-size and the per-class scores, as YOLOX/YOLOv8 without the objectness branch),
exported with its box decoding inside to one output [N, A, 4 + C] (cx, cy, w, h in
input pixels, sigmoid class scores) and no NMS: the `yolo` decoder does that.

It takes a float NCHW grey image in 0..1 of any size divisible by 8 (so `optimize` can
try lower resolutions), and is trained here for about a minute on the synthetic
canvases of scikit-learn's digits. Nothing in bitserve trained or built it.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bitserve.vision import data

STRIDE = 8

CONFIG = """\
backend = "detector"
max_batch_size = 8

[[input]]
name = "image"
datatype = "UINT8"
dims = [-1, -1, -1]

[[output]]
name = "boxes"
datatype = "FP32"
dims = [-1, 4]

[[output]]
name = "scores"
datatype = "FP32"
dims = [-1]

[[output]]
name = "classes"
datatype = "INT32"
dims = [-1]

[[output]]
name = "num_detections"
datatype = "INT32"
dims = [1]

[parameters]
score_threshold = 0.05
max_detections = 20

[parameters.preprocess]
size = [128, 128]
resize = "letterbox"
channels = "grey"
layout = "nchw"
scale = 255.0

[parameters.outputs]
decoder = "yolo"
output = "predictions"
iou_threshold = 0.5

[dynamic_batching]
max_queue_delay_ms = 2

[instance_group]
threads = 1
"""


def _cbr(cin, cout, stride=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class Yolo(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        w = width
        self.backbone = nn.Sequential(
            _cbr(1, w, 2), _cbr(w, w), _cbr(w, 2 * w, 2), _cbr(2 * w, 2 * w), _cbr(2 * w, 4 * w, 2)
        )
        self.neck = nn.Sequential(_cbr(4 * w, 4 * w), _cbr(4 * w, 4 * w))
        self.box = nn.Sequential(_cbr(4 * w, 2 * w), nn.Conv2d(2 * w, 4, 1))
        self.cls = nn.Sequential(_cbr(4 * w, 2 * w), nn.Conv2d(2 * w, num_classes, 1))
        nn.init.constant_(self.cls[-1].bias, -4.0)

    def heads(self, x):
        feature = self.neck(self.backbone(x))
        return self.box(feature), self.cls(feature)

    def forward(self, x):
        """x: [N, 1, H, W] -> [N, H/8 * W/8, 4 + C]: cx, cy, w, h (input pixels), scores."""
        box, cls = self.heads(x)
        n, _, h, w = box.shape
        ys = torch.arange(h, dtype=torch.float32).view(1, h, 1).expand(1, h, w)
        xs = torch.arange(w, dtype=torch.float32).view(1, 1, w).expand(1, h, w)
        cx = (xs + torch.sigmoid(box[:, 0])) * STRIDE
        cy = (ys + torch.sigmoid(box[:, 1])) * STRIDE
        bw, bh = (
            torch.exp(box[:, 2].clamp(max=6)) * STRIDE,
            torch.exp(box[:, 3].clamp(max=6)) * STRIDE,
        )
        boxes = torch.stack([cx, cy, bw, bh], dim=-1).reshape(n, h * w, 4)
        scores = torch.sigmoid(cls).permute(0, 2, 3, 1).reshape(n, h * w, -1)
        return torch.cat([boxes, scores], dim=-1)


def _targets(canvases, size=128):
    cells = size // STRIDE
    n = len(canvases)
    cls = np.zeros((n, 10, cells, cells), np.float32)
    box = np.zeros((n, 4, cells, cells), np.float32)
    mask = np.zeros((n, cells, cells), np.float32)
    for i, c in enumerate(canvases):
        for (x, y, w, h), label in zip(c.boxes, c.labels, strict=True):
            cx, cy = (x + w / 2) / STRIDE, (y + h / 2) / STRIDE
            gi, gj = min(int(cx), cells - 1), min(int(cy), cells - 1)
            cls[i, label, gj, gi] = 1.0
            box[i, :, gj, gi] = (cx - gi, cy - gj, np.log(w / STRIDE), np.log(h / STRIDE))
            mask[i, gj, gi] = 1.0
    return torch.from_numpy(cls), torch.from_numpy(box), torch.from_numpy(mask)


def train(seconds: float = 60.0, seed: int = 0, batch: int = 8) -> Yolo:
    """Adam on fresh canvases (scikit-learn's training pool) until `seconds` have passed."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = Yolo()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    pools = data.pools()
    start = time.perf_counter()
    model.train()
    steps = 0
    while time.perf_counter() - start < seconds:
        steps += 1
        canvases = [
            data.make_canvas(rng, pools.train_images, pools.train_labels) for _ in range(batch)
        ]
        x = torch.from_numpy(np.stack([c.image for c in canvases])[:, None]).float() / 255
        cls_t, box_t, mask = _targets(canvases)
        box, cls = model.heads(x)
        focal = torch.sigmoid(cls)
        bce = F.binary_cross_entropy_with_logits(cls, cls_t, reduction="none")
        weight = torch.where(cls_t > 0, (1 - focal) ** 2, focal**2)
        count = mask.sum().clamp(min=1)
        loss_cls = (bce * weight).sum() / count
        offsets = torch.sigmoid(box[:, :2])
        pred = torch.cat([offsets, box[:, 2:]], 1)
        loss_box = ((pred - box_t).abs() * mask[:, None]).sum() / count
        loss = loss_cls + loss_box
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.steps = steps
    return model.eval()


def export(model: Yolo, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (torch.zeros(1, 1, 128, 128),),
            str(path),
            input_names=["images"],
            output_names=["predictions"],
            dynamic_axes={
                "images": {0: "batch", 2: "height", 3: "width"},
                "predictions": {0: "batch", 1: "anchors"},
            },
            opset_version=17,
            dynamo=False,
        )
    return path


def coco_folder(folder: Path, count: int = 60) -> Path:
    """Held-out canvases (digits the network never saw) as a COCO folder."""
    from bitserve.vision import coco

    canvases = data.heldout(count)
    coco.write(
        folder,
        [c.image for c in canvases],
        [c.boxes for c in canvases],
        [c.labels for c in canvases],
    )
    return folder


def repository_model(folder: Path, graph: Path) -> Path:
    """A repository model folder: config.toml (the declaration above) and 1/model.onnx."""
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(CONFIG)
    (folder / "1" / "model.onnx").write_bytes(graph.read_bytes())
    return folder
