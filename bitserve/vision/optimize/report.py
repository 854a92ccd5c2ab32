"""The optimize report: a table, a speed-accuracy scatter with the Pareto front, JSON.

Speed-up is the baseline's batch-1 p50 over the variant's (CPU time of the one thread
that runs it, bitserve/vision/optimize/measure.py says why); a mAP delta is in points
(1 point = 0.01 mAP). A variant is on the Pareto front when no other is both faster
and at least as accurate.
"""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = (
    ("variant", "{name}"),
    ("mAP", "{map:.3f}"),
    ("mAP@.5", "{map50:.3f}"),
    ("dmAP pts", "{delta_points:+.1f}"),
    ("p50 ms", "{p50_ms:.2f}"),
    ("p95 ms", "{p95_ms:.2f}"),
    ("wall p50", "{wall_p50_ms:.2f}"),
    ("speed-up", "{speedup:.2f}x"),
    ("b8 img/s", "{throughput_b8:.0f}"),
    ("size KB", "{size_kb:.0f}"),
    ("train min", "{train_minutes:.1f}"),
)


def rows(variants, baseline: str) -> list[dict]:
    base = next(v for v in variants if v.name == baseline).metrics
    table = []
    for v in variants:
        m = v.metrics
        table.append(
            {
                "name": v.name,
                "techniques": v.techniques,
                "resolution": v.resolution,
                "onnx": v.onnx,
                **m,
                "delta_points": 100 * (m["map"] - base["map"]),
                "speedup": base["p50_ms"] / m["p50_ms"],
                "size_kb": v.size_bytes / 1024,
                "train_minutes": v.train_minutes,
            }
        )
    front = pareto(table)
    for row in table:
        row["pareto"] = row["name"] in front
    return table


def pareto(table: list[dict]) -> set[str]:
    front = set()
    for row in table:
        beaten = any(
            o["p50_ms"] < row["p50_ms"] and o["map"] >= row["map"] for o in table if o is not row
        )
        if not beaten:
            front.add(row["name"])
    return front


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " | Pareto |"]
    lines.append("|" + "---|" * (len(COLUMNS) + 1))
    for row in table:
        cells = [fmt.format(**row) for _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + f" | {'*' if row['pareto'] else ''} |")
    return "\n".join(lines)


def scatter(table: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for row in table:
        color = "tab:red" if row["pareto"] else "tab:blue"
        ax.scatter(row["speedup"], 100 * row["map"], color=color, zorder=3)
        ax.annotate(
            row["name"],
            (row["speedup"], 100 * row["map"]),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    front = sorted((r for r in table if r["pareto"]), key=lambda r: r["speedup"])
    ax.plot(
        [r["speedup"] for r in front],
        [100 * r["map"] for r in front],
        "r--",
        zorder=2,
        label="Pareto front",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch-1 speed-up over the teacher (p50 CPU time, one thread)")
    ax.set_ylabel("mAP@[.5:.95] on the held-out set (points)")
    ax.set_title("detector variants: speed against accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(table: list[dict], extra: dict, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": folder / "report.json",
        "table": folder / "report.md",
        "plot": folder / "pareto.png",
    }
    paths["json"].write_text(json.dumps({"variants": table, **extra}, indent=2) + "\n")
    paths["table"].write_text(markdown(table) + "\n")
    scatter(table, paths["plot"])
    return paths
