"""Training loops shared by the teacher (tools/train_detector.py), the pruned network's
fine-tune and the distilled student (bitserve/vision/optimize).

Each step draws a fresh batch of synthetic canvases from a seeded generator and a
random input resolution (half at 128, the rest at 96 or 64), so one set of weights
serves every resolution variant. Threads are the caller's business: the tools pin
torch to one. Training runs channels-last (oneDNN's convolutions are about a quarter
cheaper on this CPU that way) and hands the network back in the default layout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from bitserve.vision import data, net

RESOLUTIONS = (128, 128, 128, 96, 96, 64)


@dataclass
class TrainConfig:
    steps: int = 1000
    batch: int = 32
    lr: float = 2e-3
    seed: int = 0
    resolutions: tuple[int, ...] = RESOLUTIONS
    log_every: int = 25


def batch_tensors(rng: np.random.Generator, count: int, resolution: int):
    canvases = data.training_batch(rng, count)
    images = np.stack([c.image for c in canvases])
    x = net.to_input(images, resolution).contiguous(memory_format=torch.channels_last)
    heat, reg, mask = net.targets(
        [c.boxes for c in canvases], [c.labels for c in canvases], resolution
    )
    return x, heat, reg, mask


def train(
    model: net.CenterNet,
    config: TrainConfig,
    loss_fn: Callable | None = None,
    log: Callable[[str], None] = print,
) -> float:
    """Adam with a cosine schedule; returns the minutes it took. A `loss_fn` that is a
    module (a distillation's adapter) trains its parameters beside the model's."""
    loss_fn = loss_fn or net.detection_loss
    rng = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    extra = list(loss_fn.parameters()) if isinstance(loss_fn, torch.nn.Module) else []
    optimizer = torch.optim.AdamW([*model.parameters(), *extra], lr=config.lr, weight_decay=1e-4)
    warmup = max(1, config.steps // 20)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (config.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.to(memory_format=torch.channels_last).train()
    start, running = time.perf_counter(), 0.0
    for step in range(config.steps):
        resolution = int(rng.choice(config.resolutions))
        loss = loss_fn(model, *batch_tensors(rng, config.batch, resolution))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        running += loss.item()
        if (step + 1) % config.log_every == 0:
            elapsed = time.perf_counter() - start
            mean = running / config.log_every
            log(f"step {step + 1}/{config.steps} loss {mean:.3f} {elapsed:.0f}s")
            running = 0.0
    model.to(memory_format=torch.contiguous_format).eval()
    return (time.perf_counter() - start) / 60


class Distillation(torch.nn.Module):
    """The student's loss: the ground-truth loss, plus what the teacher computes on the
    same batch: its heatmaps as soft targets (binary cross-entropy against its
    probabilities, per object), its regression at the true centres, and its neck
    features (FitNets: a 1x1 `adapter`, trained with the student and then dropped, maps
    the student's narrower features onto the teacher's; squared error relative to the
    teacher's feature energy, times `feature_weight`).

    The teacher runs as an onnxruntime graph of its features and heads: its forward
    pass is the largest part of a step in eager torch and about 0.65 of that here."""

    def __init__(self, teacher: net.CenterNet, student_width: int, feature_weight: float = 1.0):
        super().__init__()
        self.teacher = _teacher_session(teacher)
        self.adapter = torch.nn.Conv2d(student_width, teacher.widths[3], 1)
        self.feature_weight = feature_weight

    def forward(self, student: net.CenterNet, x, heat, reg, mask) -> torch.Tensor:
        soft_logits, soft_reg, soft_feature = self.teacher(x)
        feature = student.features(x)
        logits, pred = student.heads(feature)
        hard = net.focal_loss(logits, heat) + net.regression_loss(pred, reg, mask)
        soft = F.binary_cross_entropy_with_logits(
            logits, torch.sigmoid(soft_logits), reduction="sum"
        ) - F.binary_cross_entropy_with_logits(
            soft_logits, torch.sigmoid(soft_logits), reduction="sum"
        )
        soft = soft / mask.sum().clamp(min=1) + net.regression_loss(pred, soft_reg, mask)
        imitation = F.mse_loss(self.adapter(feature), soft_feature)
        imitation = imitation / soft_feature.pow(2).mean().clamp(min=1e-6)
        return hard + soft + self.feature_weight * imitation


class _TeacherOutputs(torch.nn.Module):
    def __init__(self, teacher: net.CenterNet):
        super().__init__()
        self.teacher = teacher

    def forward(self, x):
        feature = self.teacher.features(x)
        return (*self.teacher.heads(feature), feature)


def _teacher_session(teacher: net.CenterNet) -> Callable:
    """x [N, 1, H, W] -> the teacher's heatmap logits, regression and neck features,
    from an in-memory ONNX graph on as many threads as torch has."""
    import io
    import warnings

    import onnxruntime as ort

    graph = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            _TeacherOutputs(teacher).eval(),  # the export restores this mode: eval
            (torch.zeros(1, 1, 128, 128),),
            graph,
            input_names=["x"],
            output_names=["heatmap", "regression", "feature"],
            dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}},
            opset_version=17,
            dynamo=False,
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(graph.getvalue(), options, providers=["CPUExecutionProvider"])

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        outputs = session.run(None, {"x": x.contiguous().numpy()})
        return [torch.from_numpy(o) for o in outputs]

    return run
