"""Export a detector to ONNX: one graph from the raw uint8 image to the top-K peaks.

The graph holds the preprocessing (grey, scale to 0..1, resize to the variant's
resolution), the network and the decoding (sigmoid, 3x3 max-pool peak test, top K,
boxes scaled back to the image's own pixels). Batch, height and width are dynamic;
the channel count is 1 or 3. The same graph is what onnxruntime's int8 quantizer
rewrites, what the `detector` backend serves and what the benchmark times.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from bitserve.vision import net

OPSET = 17
INPUT, OUTPUTS = "image", ("boxes", "scores", "classes")


def export(model: net.CenterNet, resolution: int, path: Path) -> Path:
    deployed = net.Deployed(model.eval(), resolution).eval()
    example = torch.zeros(1, 128, 128, 1, dtype=torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            deployed,
            (example,),
            str(path),
            input_names=[INPUT],
            output_names=list(OUTPUTS),
            dynamic_axes={INPUT: {0: "batch", 1: "height", 2: "width", 3: "channels"}}
            | {name: {0: "batch"} for name in OUTPUTS},
            opset_version=OPSET,
            dynamo=False,
        )
    return path
