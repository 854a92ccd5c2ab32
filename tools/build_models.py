"""Build the generated version files of the default model repository.

    python tools/build_models.py --repository models [--force]

Two models are generated rather than committed (they are a few MB of random weights):

- `mlp/1/model.pt2`: a 512 -> 1024 -> 1024 -> 512 ReLU MLP (2.1M FP32 parameters),
  exported with `torch.export` with a dynamic batch dimension (1..1024). It is the
  compute-bound model that shows what batching buys.
- `bow_classifier/1/model.onnx`: a bag-of-words classifier written node by node with
  `onnx.helper` (no torch exporter, so the graph is exactly what is written here). It
  takes padded token ids and their mask, so it exercises ragged batching: the masked
  mean makes a padded row's probabilities equal to the unpadded row's.

Weights come from fixed seeds, so every build computes the same functions. Existing
files are kept unless `--force`.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

SEED = 0
MLP_SIZES = (512, 1024, 1024, 512)
MLP_MAX_BATCH = 1024
VOCAB, EMBED_DIM, CLASSES = 1000, 64, 4
ONNX_OPSET, ONNX_IR_VERSION = 17, 8  # IR 8 keeps older onnxruntime (>= 1.14) able to read it


def build_mlp(path: Path) -> None:
    """Export the MLP to `path` (a torch.export archive)."""
    import torch

    torch.manual_seed(SEED)
    layers: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(MLP_SIZES)):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(MLP_SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).eval()
    batch = torch.export.Dim("batch", min=1, max=MLP_MAX_BATCH)
    example = (torch.zeros(2, MLP_SIZES[0]),)
    program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    torch.export.save(program, path)


def bow_weights() -> dict[str, np.ndarray]:
    """The classifier's weights; tests recompute the graph from these in numpy."""
    rng = np.random.default_rng(SEED)
    return {
        "embedding": rng.normal(0, 1, (VOCAB, EMBED_DIM)).astype(np.float32),
        "weight": rng.normal(0, EMBED_DIM**-0.5, (EMBED_DIM, CLASSES)).astype(np.float32),
        "bias": rng.normal(0, 0.1, (CLASSES,)).astype(np.float32),
    }


def build_bow_classifier(path: Path) -> None:
    """Write the bag-of-words ONNX graph to `path`.

    probs = softmax(mean(embedding[ids] over positions where mask == 1) @ W + b); the
    count is clamped to 1 so that an all-padding row gives the bias's softmax, not NaN.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = bow_weights()
    initializers = [
        numpy_helper.from_array(w["embedding"], "embedding"),
        numpy_helper.from_array(w["weight"], "weight"),
        numpy_helper.from_array(w["bias"], "bias"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis_seq"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "axis_last"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
    ]
    node = helper.make_node
    nodes = [
        node("Gather", ["embedding", "input_ids"], ["vectors"], axis=0),  # [B, S, D]
        node("Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),  # [B, S]
        node("Unsqueeze", ["mask_f", "axis_last"], ["mask_3d"]),  # [B, S, 1]
        node("Mul", ["vectors", "mask_3d"], ["masked"]),
        node("ReduceSum", ["masked", "axis_seq"], ["summed"], keepdims=0),  # [B, D]
        node("ReduceSum", ["mask_f", "axis_seq"], ["count"], keepdims=1),  # [B, 1]
        node("Max", ["count", "one"], ["count_safe"]),
        node("Div", ["summed", "count_safe"], ["mean"]),
        node("MatMul", ["mean", "weight"], ["scores"]),
        node("Add", ["scores", "bias"], ["logits"]),
        node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "bow_classifier",
        inputs=[
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        outputs=[helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        producer_name="bitserve tools/build_models.py",
        ir_version=ONNX_IR_VERSION,
    )
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)


def build_detector(path: Path) -> None:
    """Export the committed teacher (models/detector/teacher.safetensors, trained by
    tools/train_detector.py) to the servable graph at 128 px."""
    import torch

    from bitserve.vision import export, weights

    torch.set_num_threads(1)
    teacher = weights.load(path.parent.parent / "teacher.safetensors")
    export.export(teacher, 128, path)


BUILDERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "mlp": ("1/model.pt2", build_mlp),
    "bow_classifier": ("1/model.onnx", build_bow_classifier),
    "detector": ("1/model.onnx", build_detector),
}


def build(repository: Path, force: bool = False, names: Iterable[str] | None = None) -> list[Path]:
    """Build the files of `names` (default: all) under `repository`; return those written."""
    written = []
    for name in names if names is not None else BUILDERS:
        relative, builder = BUILDERS[name]
        path = Path(repository) / name / relative
        if path.exists() and not force:
            print(f"{path}: exists, kept (--force rebuilds)")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename, so an interrupted build leaves no torn file.
        partial = path.with_name(f"{path.stem}.partial{path.suffix}")
        builder(partial)
        partial.replace(path)
        print(f"{path}: built ({path.stat().st_size / 1e6:.1f} MB)")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--force", action="store_true", help="rebuild files that exist")
    args = parser.parse_args(argv)
    build(args.repository, force=args.force)


if __name__ == "__main__":
    main()
