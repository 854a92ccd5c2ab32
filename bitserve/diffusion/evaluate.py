"""`bitserve eval` for a diffusion model: how guidance trades diversity for adherence.

For each guidance scale s (0, 1, 3, 5 by default) the model draws `samples` images of
every class, all scales and classes batched through one engine, and a judge (a digit
classifier trained on real digits only, `<model>/eval/judge.safetensors`) scores them:

* adherence: the judge's accuracy on the generated digits (does a "7" read as a 7?);
* diversity: the mean pairwise distance between the judge's features of same-class
  samples, averaged over classes (the same measure on real digits is the reference);
* Fréchet distance: between Gaussians fitted to the judge's features of the generated
  digits and of real held-out digits (`<model>/eval/heldout.safetensors`), as FID
  does with Inception features.

Writes `eval.json`, `grid.png` (rows = classes, columns = scales) and `guidance.png`
(adherence and diversity against scale) to the report folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from bitserve.config import load_config, version_numbers
from bitserve.diffusion.engine import DiffusionEngine
from bitserve.diffusion.judge import Judge
from bitserve.diffusion.params import GenerationParams
from bitserve.diffusion.sampler import to_uint8
from bitserve.diffusion.unet import load_denoiser

SCALES = (0.0, 1.0, 3.0, 5.0)


@dataclass
class Samples:
    images: torch.Tensor  # [N, H, W] in [0, 1]
    labels: np.ndarray  # the requested class of each
    scales: np.ndarray


def weights_path(model_dir: Path) -> Path:
    """The latest version's weights of a repository model folder."""
    config = load_config(model_dir / "config.toml")
    versions = version_numbers(model_dir)
    if not versions:
        raise FileNotFoundError(f"{model_dir}: no version folder")
    return model_dir / str(versions[-1]) / config.parameters.get("weights", "model.safetensors")


def load_judge(folder: Path) -> Judge:
    judge = Judge()
    judge.load_state_dict(load_file(str(folder / "judge.safetensors")))
    return judge.eval()


def generate(
    engine: DiffusionEngine, scales: tuple, samples: int, steps: int, seed: int
) -> Samples:
    """`samples` images per class per scale; image k of a class uses seed + k at every
    scale, so the columns of the grid differ only by the scale."""
    classes = engine.model.config.classes
    rows, labels, used = [], [], []
    for scale in scales:
        for label in range(classes):
            for k in range(samples):
                params = GenerationParams(label, float(scale), steps, seed + k)
                rows.append(engine.submit(params))
                labels.append(label)
                used.append(scale)
    while engine.step():
        pass
    images = torch.stack([row.future.result() for row in rows])
    return Samples(images, np.array(labels), np.array(used))


@torch.no_grad()
def features(judge: Judge, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(judge features [N, 64], predicted labels [N]) of images in [0, 1]."""
    x = images.unsqueeze(1).mul(2).sub(1)
    f = judge.features(x)
    return f.numpy().astype(np.float64), judge.head(f).argmax(1).numpy()


def diversity(feats: np.ndarray, labels: np.ndarray) -> float:
    """Mean pairwise Euclidean distance within each class, averaged over classes."""
    means = []
    for label in np.unique(labels):
        f = feats[labels == label]
        if len(f) < 2:
            continue
        d = np.sqrt(((f[:, None, :] - f[None, :, :]) ** 2).sum(-1))
        means.append(d.sum() / (len(f) * (len(f) - 1)))
    return float(np.mean(means)) if means else 0.0


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(C_a + C_b - 2 (C_a C_b)^(1/2)).

    Tr (C_a C_b)^(1/2) = Tr (C_a^(1/2) C_b C_a^(1/2))^(1/2), a symmetric PSD matrix, so
    both roots come from eigh: stable even when few samples make a covariance singular."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _psd_sqrt(ca)
    inner = np.linalg.eigvalsh(root_a @ cb @ root_a)
    trace_root = np.sqrt(np.clip(inner, 0, None)).sum()
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(ca) + np.trace(cb) - 2 * trace_root)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def evaluate(
    model_dir: Path,
    samples: int = 50,
    steps: int = 30,
    scales: tuple = SCALES,
    seed: int = 0,
    report: Path | None = None,
) -> dict:
    started = time.perf_counter()
    model, schedule = load_denoiser(weights_path(model_dir))
    engine = DiffusionEngine(model, schedule, max_rows=256, max_waiting=1 << 20)
    judge = load_judge(model_dir / "eval")
    real = load_file(str(model_dir / "eval" / "heldout.safetensors"))
    real_images = real["images"].float().div(255)
    real_labels = real["labels"].numpy()
    real_feats, real_pred = features(judge, real_images)
    drawn = generate(engine, scales, samples, steps, seed)
    feats, pred = features(judge, drawn.images)
    rows = []
    for scale in scales:
        pick = drawn.scales == scale
        rows.append(
            {
                "guidance_scale": float(scale),
                "adherence": float((pred[pick] == drawn.labels[pick]).mean()),
                "diversity": diversity(feats[pick], drawn.labels[pick]),
                "frechet": frechet(feats[pick], real_feats),
            }
        )
    half = len(real_feats) // 2
    result = {
        "kind": "diffusion",
        "model": str(model_dir),
        "samples_per_class": samples,
        "steps": steps,
        "sampler": "ddim (eta 0)",
        "scales": rows,
        "real": {
            "judge_accuracy": float((real_pred == real_labels).mean()),
            "diversity": diversity(real_feats, real_labels),
            "frechet_half_vs_half": frechet(real_feats[:half], real_feats[half:]),
            "count": len(real_labels),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        (report / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        grid(drawn, scales, report / "grid.png")
        plot(result, report / "guidance.png")
    return result


def grid(drawn: Samples, scales: tuple, path: Path, per_cell: int = 4, zoom: int = 3) -> None:
    """Rows = classes, columns = scales; each cell shows the first `per_cell` samples."""
    from PIL import Image, ImageDraw

    classes = int(drawn.labels.max()) + 1
    size = drawn.images.shape[-1] * zoom
    pad, top, left = 6, 18, 16
    cell_w = per_cell * size
    width = left + len(scales) * (cell_w + pad)
    canvas = Image.new("L", (width, top + classes * (size + pad)), 255)
    draw = ImageDraw.Draw(canvas)
    pixels = to_uint8(drawn.images)
    for j, scale in enumerate(scales):
        x0 = left + j * (cell_w + pad)
        draw.text((x0, 3), f"s = {scale:g}", fill=0)
        for label in range(classes):
            idx = np.flatnonzero((drawn.scales == scale) & (drawn.labels == label))[:per_cell]
            y0 = top + label * (size + pad)
            if j == 0:
                draw.text((3, y0 + size // 3), str(label), fill=0)
            for k, i in enumerate(idx):
                tile = Image.fromarray(pixels[i], mode="L").resize((size, size), Image.NEAREST)
                canvas.paste(tile, (x0 + k * size, y0))
    canvas.save(path)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["scales"]
    s = [r["guidance_scale"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(s, [r["adherence"] for r in rows], "o-", color="tab:blue", label="adherence")
    ax.set_xlabel("guidance scale s")
    ax.set_ylabel("judge accuracy (adherence)", color="tab:blue")
    ax.set_ylim(0, 1.02)
    other = ax.twinx()
    other.plot(s, [r["diversity"] for r in rows], "s--", color="tab:red", label="diversity")
    other.axhline(result["real"]["diversity"], color="tab:red", lw=0.8, ls=":")
    other.set_ylabel("within-class diversity (judge features)", color="tab:red")
    ax.set_title("Classifier-free guidance: adherence vs diversity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [f"{'scale':>6} {'adherence':>10} {'diversity':>10} {'Fréchet':>9}"]
    for r in result["scales"]:
        lines.append(
            f"{r['guidance_scale']:>6g} {r['adherence']:>10.3f} {r['diversity']:>10.3f} "
            f"{r['frechet']:>9.3f}"
        )
    real = result["real"]
    lines.append(
        f"{'real':>6} {real['judge_accuracy']:>10.3f} {real['diversity']:>10.3f} "
        f"{real['frechet_half_vs_half']:>9.3f}  (held-out digits; Fréchet: half vs half)"
    )
    return "\n".join(lines)


def main(model_dir: Path, samples: int, report: Path | None, as_json: bool) -> None:
    """`bitserve eval MODEL_DIR` for a diffusion model: the table, then a JSON line."""
    import sys

    result = evaluate(model_dir, samples=samples, report=report or model_dir / "eval")
    if not as_json:
        print(format_table(result))
    print(json.dumps(result))
    sys.stdout.flush()
