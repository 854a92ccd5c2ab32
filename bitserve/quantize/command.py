"""`bitserve quantize` and `bitserve eval`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from bitserve.llm.quant.quantize import GROUP_SIZES, METHODS

log = logging.getLogger("bitserve.quant")


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--method", type=click.Choice(METHODS), default="int8", show_default=True)
@click.option(
    "--group-size",
    type=click.Choice([str(g) for g in GROUP_SIZES]),
    default="32",
    show_default=True,
    help="int4: input channels per scale/zero pair.",
)
@click.option(
    "--threshold",
    type=float,
    default=6.0,
    show_default=True,
    help="int8-outlier and --profile: |activation| above which an input channel is an outlier.",
)
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Sample text for the activation profile (int8-outlier, --profile).",
)
@click.option("--calibration-tokens", type=int, default=4096, show_default=True)
@click.option(
    "--activations",
    type=click.Choice(["int8", "bf16"]),
    default=None,
    help="int8: also quantize activations (W8A8, vector-wise) where _int_mm runs, or keep "
    "them bf16 (weight-only). Default: int8 for LLMs, bf16 for hf encoders.",
)
@click.option(
    "--version",
    type=int,
    default=None,
    help="Write the weights to OUT_DIR/N/ (a new version of a repository model).",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Only profile activations: print the outlier report and write a PNG.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="--profile: where the PNG goes (default OUT_DIR/outliers.png or ./outliers.png).",
)
@click.option("--threads", type=int, default=0, help="torch threads (0: torch's default).")
def quantize(
    model_dir: Path,
    out_dir: Path | None,
    method: str,
    group_size: str,
    threshold: float,
    calibration: Path | None,
    calibration_tokens: int,
    activations: str | None,
    version: int | None,
    profile: bool,
    plot: Path | None,
    threads: int,
) -> None:
    """Quantize MODEL_DIR into OUT_DIR: int8, int8-outlier (LLM.int8()) or int4.

    MODEL_DIR is a repository model folder (config.toml + versions) or a bare weights
    folder (config.json + safetensors). The output loads like any model in serve, batch
    and LLM(); the method is recorded in config.json's quantization_config.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _threads(threads)
    from bitserve.quantize.folders import resolve_source

    source = resolve_source(model_dir)
    if profile:
        return _profile(source.weights, source.backend, calibration, threshold, plot, out_dir,
                        calibration_tokens)  # fmt: skip
    if out_dir is None:
        raise click.UsageError("OUT_DIR is required (except with --profile)")
    if method == "int8-outlier" and calibration is None:
        raise click.UsageError("--method int8-outlier needs --calibration FILE (sample text)")
    if source.backend == "hf":
        size, target = _quantize_encoder(
            source, out_dir, method, int(group_size), version, activations or "bf16"
        )
    else:
        size, target = _quantize_llm(
            source, out_dir, method, int(group_size), threshold, calibration,
            calibration_tokens, version, activations or "int8",
        )  # fmt: skip
    click.echo(f"wrote {target} ({method}, weights {size / 2**20:.2f} MiB)")


def _threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def _profile(folder, backend, calibration, threshold, plot, out_dir, tokens) -> None:
    from bitserve.quantize.calibrate import calibrate_folder, report
    from bitserve.quantize.calibrate import plot as draw

    if backend != "llm":
        raise click.UsageError("--profile works on LLM folders")
    if calibration is None:
        raise click.UsageError("--profile needs --calibration FILE (sample text)")
    _, profiles = calibrate_folder(folder, calibration.read_text(), max_tokens=tokens)
    click.echo(report(profiles, threshold))
    path = plot or ((out_dir or Path(".")) / "outliers.png")
    click.echo(f"plot: {draw(profiles, threshold, path)}")


def _quantize_llm(
    source, out_dir, method, group_size, threshold, calibration, tokens, version, activations="int8"
):
    from bitserve.llm.config import EngineConfig
    from bitserve.llm.models import load_model
    from bitserve.llm.quant.quantize import is_quantized, quantize_model, save_weights, write_config
    from bitserve.quantize.folders import copy_companions, destination

    config = EngineConfig(model=source.weights, device="cpu", num_kv_blocks=1)
    if is_quantized(config.hf_config):
        raise click.UsageError(f"{source.weights} is quantized already")
    outliers = None
    if method == "int8-outlier":
        from bitserve.quantize.calibrate import calibrate_folder, report

        model, profiles = calibrate_folder(
            source.weights, calibration.read_text(), max_tokens=tokens
        )
        outliers = {name: p.outliers(threshold) for name, p in profiles.items()}
        log.info("calibration:\n%s", report(profiles, threshold))
    else:
        model = load_model(config)
    qconfig = quantize_model(model, method, group_size, outliers, threshold, activations)
    target = destination(out_dir, source, version)
    copy_companions(source.weights, target)
    write_config(source.weights, target, qconfig)
    return save_weights(model, target, qconfig), target


def _quantize_encoder(source, out_dir, method, group_size, version, activations="bf16"):
    from bitserve.llm.quant.encoder import ENCODER_METHODS, quantize_encoder, save_encoder
    from bitserve.llm.quant.quantize import write_config
    from bitserve.quantize.folders import copy_companions, destination

    if method not in ENCODER_METHODS:
        raise click.UsageError(f"encoder (hf) models take --method {' or '.join(ENCODER_METHODS)}")
    model, qconfig = quantize_encoder(source.weights, method, group_size, activations)
    target = destination(out_dir, source, version)
    copy_companions(source.weights, target)
    write_config(source.weights, target, qconfig)
    return save_encoder(model, target), target


def is_diffusion(model_dir: Path) -> bool:
    from bitserve.config import load_config

    toml = model_dir / "config.toml"
    return toml.is_file() and load_config(toml).backend == "diffusion"


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, path_type=Path))  # or a .gguf
@click.option(
    "--against",
    "reference",
    type=click.Path(exists=True, path_type=Path),
    help="The reference (full-precision) model to compare with.",
)
@click.option(
    "--text",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Held-out text (LLM: perplexity; encoder: one sentence per line). Required but "
    "for diffusion models.",
)
@click.option("--window", type=int, default=256, show_default=True, help="LLM: tokens per window.")
@click.option("--max-tokens", type=int, default=None, help="LLM: score at most this many tokens.")
@click.option("--new-tokens", type=int, default=64, show_default=True, help="LLM: greedy tokens.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON result.")
@click.option("--threads", type=int, default=0, help="torch threads (0: torch's default).")
@click.option("--samples", type=int, default=50, show_default=True, help="Diffusion: per class.")
@click.option("--report", type=click.Path(path_type=Path), help="Diffusion: figures folder.")
def evaluate(
    model_dir: Path,
    reference: Path | None,
    text: Path | None,
    window: int,
    max_tokens: int | None,
    new_tokens: int,
    as_json: bool,
    threads: int,
    samples: int,
    report: Path | None,
) -> None:
    """Perplexity, agreement, cosine similarity, memory and speed of MODEL_DIR (vs --against);
    for a diffusion model, adherence, diversity and Fréchet distance per guidance scale."""
    from bitserve.quantize import evaluate as ev
    from bitserve.quantize.folders import resolve_source

    _threads(threads)
    if is_diffusion(model_dir):
        from bitserve.diffusion.evaluate import main as diffusion_eval

        return diffusion_eval(model_dir, samples, report, as_json)
    if text is None:
        raise click.UsageError("--text is required for llm and hf models")
    source = resolve_source(model_dir)
    ref = resolve_source(reference).weights if reference is not None else None
    content = text.read_text()
    if source.backend == "llm":
        result = ev.evaluate_llm(source.weights, ref, content, window, max_tokens, new_tokens)
    else:
        sentences = [line for line in content.splitlines() if line.strip()]
        result = ev.evaluate_encoder(source.weights, ref, sentences)
    if not as_json:
        click.echo(ev.format_table(result))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
