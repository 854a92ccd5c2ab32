"""Build, measure and write the variants of one detector: the body of `bitserve optimize`.

The baseline is the teacher's ONNX graph at 128 px. Each technique adds variants;
`combo` crosses the trained ones (pruned, student) with int8 and 96 px, and the best
combination is the fastest variant that loses at most `max_points_lost` mAP points.
Each ONNX variant is written as the next version of the model (`model.onnx` and
`variant.json`), servable by the `detector` backend as it stands.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bitserve.vision import data, export, net, weights
from bitserve.vision.optimize import measure, report, techniques

TECHNIQUES = ("int8", "prune", "distill", "resolution", "onnx", "combo")


@dataclass
class OptimizeConfig:
    model_dir: Path
    techniques: tuple[str, ...] = TECHNIQUES
    report_dir: Path | None = None  # default: <model_dir>/optimize
    write_versions: bool = True
    prune_ratio: float = 0.5
    prune_steps: int = 600
    distill_steps: int = 3500  # batches of techniques.STUDENT_BATCH
    heldout: int = 500
    rounds: int = 200
    max_points_lost: float = 3.0

    def __post_init__(self) -> None:
        unknown = set(self.techniques) - set(TECHNIQUES)
        if unknown:
            raise ValueError(f"unknown techniques {sorted(unknown)}; choose from {TECHNIQUES}")
        if not (self.model_dir / "teacher.safetensors").exists():
            raise ValueError(f"{self.model_dir}: no teacher.safetensors to optimize")
        self.report_dir = self.report_dir or self.model_dir / "optimize"


class Builder:
    """Exports graphs under `graphs/` and wraps each as a `measure.Variant`."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.calibration = techniques.calibration_images()

    def graph(self, name, techs, model, resolution, minutes=0.0, int8=False) -> measure.Variant:
        path = export.export(model, resolution, self.folder / f"{name}.fp32.onnx")
        if int8:
            quantized = self.folder / f"{name}.onnx"
            techniques.quantize_int8(path, quantized, self.calibration)
            path.unlink()
            path = quantized
        else:
            path = path.rename(self.folder / f"{name}.onnx")
        return measure.Variant(
            name, techs, measure.ort_run(path), resolution, path.stat().st_size, minutes, str(path)
        )


def build_variants(config: OptimizeConfig, teacher: net.CenterNet, log) -> list[measure.Variant]:
    builder = Builder(config.report_dir / "graphs")
    chosen = set(config.techniques)
    variants = [builder.graph("teacher", ["onnx"], teacher, 128)]
    if "onnx" in chosen:
        size = sum(p.numel() * 4 for p in teacher.parameters())
        eager = measure.torch_run(net.Deployed(teacher, 128).eval())
        variants.append(measure.Variant("teacher-torch", ["eager"], eager, 128, size))
    if "int8" in chosen:
        variants.append(builder.graph("int8", ["int8"], teacher, 128, int8=True))
    if "resolution" in chosen:
        variants += [builder.graph(f"res{r}", ["resolution"], teacher, r) for r in (96, 64)]
    trained = {}
    if "prune" in chosen:
        log(f"pruning {config.prune_ratio:.0%} of channels, fine-tuning {config.prune_steps} steps")
        trained["pruned"] = techniques.prune(teacher, config.prune_ratio, config.prune_steps, log)
    if "distill" in chosen:
        log(f"distilling a {net.STUDENT_WIDTHS} student for {config.distill_steps} steps")
        trained["student"] = techniques.distill(
            teacher, net.STUDENT_WIDTHS, config.distill_steps, log
        )
    for name, (model, minutes) in trained.items():
        variants.append(builder.graph(name, [name], model, 128, minutes))
        weights.save(model, builder.folder / f"{name}.safetensors", train_minutes=minutes)
        if "combo" in chosen:
            for resolution in (128, 96):
                label = f"{name}-int8" + ("" if resolution == 128 else f"-res{resolution}")
                techs = [name, "int8"] + (["resolution"] if resolution != 128 else [])
                variants.append(builder.graph(label, techs, model, resolution, minutes, True))
    return variants


def optimize(config: OptimizeConfig, log=print) -> dict:
    teacher = weights.load(config.model_dir / "teacher.safetensors")
    variants = build_variants(config, teacher, log)
    log(f"mAP of {len(variants)} variants on {config.heldout} held-out canvases")
    canvases = data.heldout(config.heldout)
    measure.accuracy(variants, canvases)
    log(f"timing: {config.rounds} interleaved rounds")
    images = np.stack([c.image for c in canvases[:64]])
    measure.speed(variants, images, config.rounds)
    table = report.rows(variants, "teacher")
    best = best_combination(table, config.max_points_lost)
    by_name = {v.name: v for v in variants}
    extra = {
        "baseline": "teacher",
        "best": best,
        "max_points_lost": config.max_points_lost,
        "threads": 1,
        "heldout_images": config.heldout,
        "batching": {
            name: measure.batch_curve(by_name[name].run, images, rounds=max(3, config.rounds // 10))
            for name in dict.fromkeys(["teacher", best])
        },
    }
    if config.write_versions:
        extra["versions"] = write_versions(config.model_dir, variants, table)
    extra["files"] = {k: str(p) for k, p in report.write(table, extra, config.report_dir).items()}
    return {"variants": table, **extra}


def best_combination(table: list[dict], max_points_lost: float) -> str:
    """The fastest variant within `max_points_lost` mAP points of the baseline."""
    fine = [r for r in table if r["delta_points"] >= -max_points_lost and r["onnx"]]
    return max(fine, key=lambda r: r["speedup"])["name"]


def write_versions(model_dir: Path, variants: list[measure.Variant], table) -> dict[str, int]:
    """Each ONNX variant but the baseline as the next free version of the model."""
    rows = {r["name"]: r for r in table}
    taken = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    number, written = max(taken, default=1), {}
    for v in variants:
        if v.onnx is None or v.name == "teacher":
            continue
        number += 1
        folder = model_dir / str(number)
        folder.mkdir()
        shutil.copyfile(v.onnx, folder / "model.onnx")
        summary = {k: rows[v.name][k] for k in ("name", "techniques", "resolution", "map", "map50")}
        (folder / "variant.json").write_text(json.dumps(summary, indent=2) + "\n")
        written[v.name] = number
    return written
