"""The speed-ups, each a function from the teacher to a faster network or graph.

Why these and not others:
- int8 *static* quantization: the convolutions run on int8 kernels (VNNI) with
  activation scales calibrated on training images. Dynamic quantization would do
  nothing here: onnxruntime and torch quantize only MatMul/Linear (and LSTM)
  dynamically, and this network is all convolutions.
- structured pruning removes whole channels (torch-pruning follows the coupled layers:
  a conv's outputs, its BatchNorm, the next conv's inputs, the neck's sum), so the
  layers really shrink; masking weights to zero would leave the FLOPs unchanged.
- distillation trains a narrower network on the teacher's heatmaps as soft targets,
  its regression and its neck features (train.Distillation).
- resolution needs no training: the network is fully convolutional and the teacher
  was trained at 128, 96 and 64 pixels.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from bitserve.vision import data, net, train

# The student trains on batches of 16 (twice the updates per canvas of the teacher's 32)
# and three in four of them at 128 px, the resolution its checked variants serve.
STUDENT_BATCH = 16
STUDENT_RESOLUTIONS = (128, 128, 128, 96)


def quantize_int8(fp32: Path, out: Path, calibration: np.ndarray) -> Path:
    """onnxruntime QDQ static quantization: int8 per-channel weights, uint8 activations
    with MinMax ranges from `calibration` (uint8 [N, H, W]).

    Conv and Relu are quantized together, so onnxruntime fuses each pair into one int8
    kernel (quantizing Conv alone left a dequantize, an FP32 Relu and a quantize between
    layers: 2.04 ms against 1.64). The first Conv stays FP32: with one input channel an
    int8 kernel has nothing to vectorise (it ran slower than FP32) and it sees raw
    pixels. The neck's Add and Resize stay FP32 too: quantizing them cost 1 mAP point
    for no measurable speed."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter({"image": image[None, ..., None]} for image in calibration)

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    import onnx

    prepared = out.with_name(out.stem + ".prep.onnx")
    quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
    convs = [n.name for n in onnx.load(str(prepared)).graph.node if n.op_type == "Conv"]
    quantize_static(
        str(prepared),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["Conv", "Relu"],
        nodes_to_exclude=convs[:1],
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    prepared.unlink()
    return out


def calibration_images(count: int = 64, seed: int = 7) -> np.ndarray:
    """Training-pool canvases (never the held-out ones) for int8 calibration."""
    return np.stack([c.image for c in data.training_batch(np.random.default_rng(seed), count)])


def prune(
    teacher: net.CenterNet, ratio: float, steps: int, log=print
) -> tuple[net.CenterNet, float]:
    """Remove `ratio` of the channels of every layer by L2 magnitude (the output heads
    keep theirs), then fine-tune for `steps` with the unpruned teacher's heatmaps as
    soft targets (the distillation loss); returns the network and the minutes."""
    import copy

    import torch_pruning as tp

    model = copy.deepcopy(teacher).eval()
    start = time.perf_counter()
    pruner = tp.pruner.MetaPruner(
        model,
        torch.zeros(1, 1, 128, 128),
        importance=tp.importance.MagnitudeImportance(p=2),
        pruning_ratio=ratio,
        ignored_layers=[model.heatmap[-1], model.regress[-1]],
    )
    pruner.step()
    minutes = (time.perf_counter() - start) / 60
    config = train.TrainConfig(steps=steps, lr=1e-3, seed=11)
    loss = train.Distillation(teacher, model.widths[3])
    return model, minutes + train.train(model, config, loss, log=log)


def distill(
    teacher: net.CenterNet, widths: tuple[int, ...], steps: int, log=print
) -> tuple[net.CenterNet, float]:
    """A student of `widths` trained from scratch on ground truth plus the teacher's
    heatmaps (soft targets), regressions and features; returns the student and the
    minutes."""
    torch.manual_seed(3)
    student = net.CenterNet(widths)
    config = train.TrainConfig(
        steps=steps, batch=STUDENT_BATCH, lr=3e-3, seed=13, resolutions=STUDENT_RESOLUTIONS
    )
    loss = train.Distillation(teacher, student.widths[3])
    return student, train.train(student, config, loss, log=log)
