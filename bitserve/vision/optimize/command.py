"""`bitserve optimize MODEL_DIR`: variants of a detector, measured speed against mAP."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bitserve.vision.optimize.run import TECHNIQUES


@click.command("optimize")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--techniques",
    default="all",
    show_default=True,
    help=f"comma-separated: {', '.join(TECHNIQUES)} (or all)",
)
@click.option(
    "--report",
    "report_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="report folder (default MODEL_DIR/optimize)",
)
@click.option("--no-versions", is_flag=True, help="measure only; write no model versions")
@click.option("--prune-ratio", default=0.5, show_default=True)
@click.option("--prune-steps", default=600, show_default=True)
@click.option("--distill-steps", default=2000, show_default=True)
@click.option("--heldout", default=500, show_default=True, help="held-out canvases for mAP")
@click.option("--rounds", default=200, show_default=True, help="interleaved timing rounds")
def optimize_command(model_dir, techniques, report_dir, no_versions, **knobs) -> None:
    """Speed up the detector in MODEL_DIR (its teacher.safetensors): int8, pruning,
    distillation, resolution, ONNX Runtime and their best combination, each measured
    (mAP, latency, throughput, size, training minutes) and written as a model version."""
    import torch

    from bitserve.vision.optimize import report
    from bitserve.vision.optimize.run import OptimizeConfig, optimize

    torch.set_num_threads(1)
    chosen = TECHNIQUES if techniques == "all" else tuple(techniques.split(","))
    try:
        config = OptimizeConfig(
            model_dir, chosen, report_dir, write_versions=not no_versions, **knobs
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result = optimize(config, log=lambda line: click.echo(line, err=True))
    click.echo(report.markdown(result["variants"]))
    click.echo(f"best combination: {result['best']}")
    for name, number in result.get("versions", {}).items():
        click.echo(f"version {number}: {name}")
    click.echo(json.dumps(result["files"]))
