"""Training loops shared by the teacher (tools/train_detector.py), the pruned network's
fine-tune and the distilled student (bitserve/vision/optimize).

Each step draws a fresh batch of synthetic canvases from a seeded generator and a
random input resolution (half at 128, the rest at 96 or 64), so one set of weights
serves every resolution variant. Threads are the caller's business: the tools pin
torch to one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

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
    x = net.to_input(images, resolution)
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
    """Adam with a cosine schedule; returns the minutes it took."""
    loss_fn = loss_fn or net.detection_loss
    rng = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=1e-4)
    warmup = max(1, config.steps // 20)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (config.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    model.train()
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
    model.eval()
    return (time.perf_counter() - start) / 60


def distillation_loss(teacher: net.CenterNet, weight: float = 1.0) -> Callable:
    """The student's loss: the ground-truth loss plus the teacher's heatmaps as soft
    targets (binary cross-entropy against its probabilities, per object) and its
    regression at the true centres."""
    teacher.eval()

    def loss(student, x, heat, reg, mask):
        with torch.no_grad():
            soft_logits, soft_reg = teacher(x)
        logits, pred = student(x)
        hard = net.focal_loss(logits, heat) + net.regression_loss(pred, reg, mask)
        soft = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.sigmoid(soft_logits), reduction="sum"
        ) - torch.nn.functional.binary_cross_entropy_with_logits(
            soft_logits, torch.sigmoid(soft_logits), reduction="sum"
        )
        soft = soft / mask.sum().clamp(min=1)
        return hard + weight * (soft + net.regression_loss(pred, soft_reg, mask))

    return loss
