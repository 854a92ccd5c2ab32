"""The detector: a CenterNet-style single-stage network, its targets and its loss.

The network maps a grayscale image to three maps at 1/4 of its resolution: a heatmap
per class whose peaks are object centres, the box size at each centre, and the
sub-cell offset of the centre. Decoding is "local maxima of the heatmap, top K": no
anchors, no NMS, nothing torchvision provides. Because every layer is a convolution,
one set of weights runs at 128, 96 or 64 pixels; `Deployed` wraps the network with
the resize in front and the peak picking behind, so that the exported ONNX graph
takes the raw uint8 image and returns boxes in its own pixel coordinates.

Invariant: `CenterNet.widths` is the whole architecture; a pruned network is rebuilt
from its widths plus a safetensors state dict, never unpickled.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

STRIDE = 4
TOP_K = 100
TEACHER_WIDTHS = (32, 64, 128, 64)  # stem, stage 2, stage 3, neck/heads
STUDENT_WIDTHS = (16, 32, 64, 32)


def _cbr(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class CenterNet(nn.Module):
    """Stem /2, two stages /4 and /8, a neck that brings /8 back to /4, two heads."""

    def __init__(self, widths=TEACHER_WIDTHS, num_classes: int = 10):
        super().__init__()
        w0, w1, w2, wh = widths
        self.stem = nn.Sequential(_cbr(1, w0, 2), _cbr(w0, w0))
        self.stage2 = nn.Sequential(_cbr(w0, w1, 2), _cbr(w1, w1), _cbr(w1, w1))
        self.stage3 = nn.Sequential(_cbr(w1, w2, 2), _cbr(w2, w2), _cbr(w2, w2))
        self.lateral = nn.Conv2d(w1, wh, 1)
        self.top = nn.Conv2d(w2, wh, 1)
        self.neck = _cbr(wh, wh)
        self.heatmap = nn.Sequential(_cbr(wh, wh), nn.Conv2d(wh, num_classes, 1))
        self.regress = nn.Sequential(_cbr(wh, wh), nn.Conv2d(wh, 4, 1))
        nn.init.constant_(self.heatmap[-1].bias, -2.19)  # prior 0.1: focal loss starts sane

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: float [N, 1, H, W] in 0..1 -> heatmap logits [N, C, H/4, W/4] and
        regression [N, 4, H/4, W/4] (width, height in cells; x, y offset in a cell)."""
        return self.heads(self.features(x))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The neck's output [N, widths[3], H/4, W/4]: what both heads read, and what a
        distilled student imitates."""
        c2 = self.stage2(self.stem(x))
        c3 = self.stage3(c2)
        up = F.interpolate(self.top(c3), size=c2.shape[-2:], mode="nearest")
        return self.neck(self.lateral(c2) + up)

    def heads(self, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heatmap(feature), self.regress(feature)

    @property
    def widths(self) -> tuple[int, int, int, int]:
        """The widths this (possibly pruned) network has now, read from its layers."""
        return (
            self.stem[0][0].out_channels,
            self.stage2[0][0].out_channels,
            self.stage3[0][0].out_channels,
            self.neck[0].out_channels,
        )


def to_input(
    images: np.ndarray | torch.Tensor, resolution: int, always_resize: bool = False
) -> torch.Tensor:
    """uint8 [N, H, W] or [N, H, W, C] -> float [N, 1, r, r] in 0..1 (the graph's own
    preprocessing, so training sees exactly what serving feeds). The export resizes
    always: a trace at 128 px that skipped the resize would bake 128 px into the graph."""
    x = torch.as_tensor(images)
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    x = x.float().mean(dim=3, keepdim=True).permute(0, 3, 1, 2) / 255.0
    if always_resize or x.shape[-1] != resolution or x.shape[-2] != resolution:
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False)
    return x


class Deployed(nn.Module):
    """uint8 image [N, H, W, C] -> boxes [N, K, 4] (x1, y1, x2, y2 in the image's pixels),
    scores [N, K], classes [N, K]: the top K heatmap peaks, best first."""

    def __init__(self, net: CenterNet, resolution: int, top_k: int = TOP_K):
        super().__init__()
        self.net, self.resolution, self.top_k = net, resolution, top_k

    def forward(self, image: torch.Tensor):
        height, width = image.shape[1], image.shape[2]
        logits, reg = self.net(to_input(image, self.resolution, always_resize=True))
        heat = torch.sigmoid(logits)
        peaks = heat * (F.max_pool2d(heat, 3, 1, 1) == heat).float()
        n, c, h, w = peaks.shape
        scores, index = peaks.reshape(n, c * h * w).topk(self.top_k, dim=1)
        classes = torch.div(index, h * w, rounding_mode="floor")
        cell = index - classes * (h * w)
        ys = torch.div(cell, w, rounding_mode="floor")
        xs = cell - ys * w
        values = reg.reshape(n, 4, h * w).gather(2, cell.unsqueeze(1).expand(n, 4, self.top_k))
        cx, cy = xs.float() + values[:, 2], ys.float() + values[:, 3]
        scale_x = width / (w * 1.0)
        scale_y = height / (h * 1.0)
        half_w, half_h = values[:, 0] / 2, values[:, 1] / 2
        boxes = torch.stack(
            [
                (cx - half_w) * scale_x,
                (cy - half_h) * scale_y,
                (cx + half_w) * scale_x,
                (cy + half_h) * scale_y,
            ],
            dim=2,
        )
        return boxes, scores, classes


def targets(boxes_list, labels_list, resolution: int, num_classes: int = 10):
    """CenterNet targets for canvases of 128 px seen at `resolution`: a Gaussian peak per
    object in its class's heatmap, and (w, h, dx, dy) at each centre cell with a mask."""
    size = resolution // STRIDE
    scale = resolution / 128 / STRIDE
    heat = np.zeros((len(boxes_list), num_classes, size, size), np.float32)
    reg = np.zeros((len(boxes_list), 4, size, size), np.float32)
    mask = np.zeros((len(boxes_list), size, size), np.float32)
    ys, xs = np.mgrid[:size, :size]
    for i, (boxes, labels) in enumerate(zip(boxes_list, labels_list, strict=True)):
        for (x, y, bw, bh), label in zip(boxes * scale, labels, strict=True):
            cx, cy = x + bw / 2, y + bh / 2
            ci, cj = min(int(cx), size - 1), min(int(cy), size - 1)
            sigma = max(0.5, 0.15 * float(np.sqrt(bw * bh)))
            g = np.exp(-((xs - ci) ** 2 + (ys - cj) ** 2) / (2 * sigma**2))
            np.maximum(heat[i, label], g, out=heat[i, label])
            reg[i, :, cj, ci] = (bw, bh, cx - ci, cy - cj)
            mask[i, cj, ci] = 1.0
    return torch.from_numpy(heat), torch.from_numpy(reg), torch.from_numpy(mask)


def focal_loss(logits: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss, normalised by the number of objects."""
    p = torch.sigmoid(logits).clamp(1e-4, 1 - 1e-4)
    pos = heat.eq(1).float()
    pos_loss = torch.log(p) * (1 - p) ** 2 * pos
    neg_loss = torch.log(1 - p) * p**2 * (1 - heat) ** 4 * (1 - pos)
    return -(pos_loss.sum() + neg_loss.sum()) / pos.sum().clamp(min=1)


def regression_loss(reg: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L1 on size (weight 0.1, as CenterNet) and offset, at object centres only."""
    m = mask.unsqueeze(1)
    l1 = (reg - target).abs() * m
    count = mask.sum().clamp(min=1)
    return (0.1 * l1[:, :2].sum() + l1[:, 2:].sum()) / count


def detection_loss(model: CenterNet, x, heat, reg, mask) -> torch.Tensor:
    logits, pred = model(x)
    return focal_loss(logits, heat) + regression_loss(pred, reg, mask)
