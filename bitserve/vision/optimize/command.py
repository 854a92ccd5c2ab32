"""`bitserve optimize MODEL_DIR [--data COCO_DIR]`: variants of a detector, measured
speed against mAP.

Without `--data`: the bundled detector (MODEL_DIR/teacher.safetensors and its training
code: int8, pruning, distillation, resolution, ONNX Runtime, combinations) on its
synthetic held-out set. With `--data`: any ONNX detector whose config declares its
preprocessing and outputs, on the user's COCO folder (bitserve/vision/optimize/onnx_graph.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from bitserve.vision.optimize.run import TECHNIQUES


@click.command("optimize")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="a COCO folder (images + instances_*.json): optimize MODEL_DIR's ONNX graph on it",
)
@click.option(
    "--techniques",
    default="all",
    show_default=True,
    help=f"comma-separated: {', '.join(TECHNIQUES)} (or all; with --data: "
    "int8, onnx, resolution, combo, layout, batching)",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="report folder (default MODEL_DIR/optimize)",
)
@click.option("--no-versions", is_flag=True, help="measure only; write no model versions")
@click.option(
    "--calibration",
    type=click.Path(path_type=Path),
    default=None,
    help="with --data: int8 calibration images (a folder) or graph inputs (.npy); "
    "default: the first --calibration-count images of the set",
)
@click.option("--calibration-count", default=32, show_default=True)
@click.option("--max-points-lost", default=None, type=float, help="mAP points a variant may lose")
@click.option("--prune-ratio", default=0.5, show_default=True)
@click.option("--prune-steps", default=600, show_default=True)
@click.option("--distill-steps", default=3500, show_default=True)
@click.option("--heldout", default=500, show_default=True, help="held-out canvases for mAP")
@click.option("--rounds", default=200, show_default=True, help="interleaved timing rounds")
def optimize_command(
    model_dir,
    data,
    techniques,
    report_dir,
    no_versions,
    calibration,
    calibration_count,
    max_points_lost,
    **knobs,
) -> None:
    """Speed up the detector in MODEL_DIR: each variant measured (mAP, latency,
    throughput, size, training minutes) and written as a model version."""
    import torch

    from bitserve.vision.optimize import report

    torch.set_num_threads(1)
    common = {"report_dir": report_dir, "write_versions": not no_versions}
    if max_points_lost is not None:  # else each config's own default: 3 bundled, 1 a graph
        common["max_points_lost"] = max_points_lost
    if data is None:
        result = _bundled(model_dir, techniques, common | knobs)
    else:
        inputs = {"calibration": calibration, "calibration_count": calibration_count}
        result = _onnx_graph(
            model_dir, data, techniques, common | inputs | {"rounds": knobs["rounds"]}
        )
    click.echo(report.markdown(result["variants"]))
    click.echo(f"best combination: {result['best']}")
    for name, number in result.get("versions", {}).items():
        click.echo(f"version {number}: {name}")
    click.echo(json.dumps(result["files"]))


def _log(line: str) -> None:
    click.echo(line, err=True)


def _bundled(model_dir: Path, techniques: str, settings: dict) -> dict:
    """The bundled detector, from its teacher.safetensors and training code."""
    from bitserve.vision.optimize.run import OptimizeConfig, optimize

    chosen = TECHNIQUES if techniques == "all" else tuple(techniques.split(","))
    try:
        config = OptimizeConfig(model_dir, chosen, **settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return optimize(config, log=_log)


def _onnx_graph(model_dir: Path, data: Path, techniques: str, settings: dict) -> dict:
    """Any declared ONNX graph, on the user's COCO folder: a config, a COCO file or a
    graph it cannot use is the caller's mistake, named as such."""
    from bitserve.config import ConfigError
    from bitserve.vision import coco, graph
    from bitserve.vision.optimize import onnx_graph

    chosen = onnx_graph.TECHNIQUES if techniques == "all" else tuple(techniques.split(","))
    try:
        config = onnx_graph.GraphOptimizeConfig(model_dir, data, chosen, **settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        return onnx_graph.optimize_graph(config, log=_log)
    except (ConfigError, coco.CocoError, graph.GraphError) as e:
        raise click.UsageError(str(e)) from None
