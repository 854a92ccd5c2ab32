"""A run's report: the terminal table, the JSON file, the plots and the comparison.

The table puts throughput next to latency on each row, because the point of a sweep is
the trade-off between them; the plot of throughput against p99 latency draws that curve,
and the TTFT CDF shows the tail a percentile hides.
"""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [  # (header, key path, format)
    ("load", ("load",), "{}"),
    ("ok", ("completed",), "{}"),
    ("err", ("failed",), "{}"),
    ("req/s", ("request_throughput",), "{:.1f}"),
    ("out tok/s", ("output_throughput",), "{:.1f}"),
    ("TTFT p50", ("ttft", "median_ms"), "{:.2f}"),
    ("TTFT p99", ("ttft", "p99_ms"), "{:.2f}"),
    ("TPOT p50", ("tpot", "median_ms"), "{:.2f}"),
    ("TPOT p99", ("tpot", "p99_ms"), "{:.2f}"),
    ("ITL p99", ("itl", "p99_ms"), "{:.2f}"),
    ("E2E mean", ("e2el", "mean_ms"), "{:.2f}"),
    ("E2E p50", ("e2el", "median_ms"), "{:.2f}"),
    ("E2E p90", ("e2el", "p90_ms"), "{:.2f}"),
    ("E2E p99", ("e2el", "p99_ms"), "{:.2f}"),
    ("goodput", ("request_goodput",), "{:.1f}"),
    ("srv queue", ("server", "mean_queue_ms"), "{:.2f}"),
    ("srv compute", ("server", "mean_compute_ms"), "{:.2f}"),
    ("srv batch", ("server", "mean_batch_size"), "{:.1f}"),
    ("spec accept", ("server", "spec_acceptance"), "{:.0%}"),
    ("spec accept/pos", ("server", "spec_acceptance_by_position"), "{}"),
]
STREAM_ONLY = {"out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99"}


def get(row: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(row, dict):
            return None
        row = row.get(key)
    return row


def table(points: list[dict]) -> str:
    """Latencies in ms; columns with no value on any row (e.g. tokens for v2) are left out."""
    cols = [c for c in COLUMNS if any(get(p, c[1]) is not None for p in points)]
    if not any(p.get("total_output_tokens") for p in points):
        cols = [c for c in cols if c[0] not in STREAM_ONLY]
    cells = [[c[0] for c in cols]]
    for p in points:
        cells.append([_cell(get(p, path), spec) for _, path, spec in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    errors = [f"{p['load']}: {p['errors']}" for p in points if p.get("errors")]
    return "\n".join(lines + (["errors: " + "; ".join(errors)] if errors else []))


def _cell(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def write_json(result: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "result.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def plots(result: dict, folder: Path) -> list[Path]:
    """throughput_latency.png (req/s against p99 E2E and TTFT per point) and ttft_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p["request_throughput"] for p in points]
    streamed = any(p.get("total_output_tokens") for p in points)
    for key, name in (("e2el", "E2E p99"), ("ttft", "TTFT p99"))[: 2 if streamed else 1]:
        y = [get(p, (key, "p99_ms")) for p in points]
        ax.plot(x, y, marker="o", label=name)
    for p, xi in zip(points, x, strict=True):
        ax.annotate(p["load"], (xi, get(p, ("e2el", "p99_ms")) or 0), fontsize=8)
    ax.set(xlabel="throughput (req/s)", ylabel="latency (ms)", title=_title(result))
    ax.legend()
    paths = [_save(fig, folder / "throughput_latency.png")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in points:
        values = sorted(p.get("samples", {}).get("ttft_ms", []))
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=p["load"])
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=_title(result))
    ax.legend()
    paths.append(_save(fig, folder / "ttft_cdf.png"))
    plt.close("all")
    return paths


def _title(result: dict) -> str:
    return (
        f"{result['config']['model']} @ {result['config']['url']} ({result['config']['workload']})"
    )


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


COMPARED = [
    ("req/s", ("request_throughput",)),
    ("out tok/s", ("output_throughput",)),
    ("TTFT p99 ms", ("ttft", "p99_ms")),
    ("TPOT p99 ms", ("tpot", "p99_ms")),
    ("E2E p50 ms", ("e2el", "median_ms")),
    ("E2E p99 ms", ("e2el", "p99_ms")),
]


TOKEN_METRICS = {"output_throughput", "ttft", "tpot"}


def compare(a: dict, b: dict) -> str:
    """Each load point present in both runs: a, b and b/a for the headline metrics."""
    by_load = {p["load"]: p for p in b["points"]}
    lines = [f"{'load':<10} {'metric':<12} {'a':>10} {'b':>10} {'b/a':>7}"]
    for pa in a["points"]:
        pb = by_load.get(pa["load"])
        if pb is None:
            continue
        tokens = pa.get("total_output_tokens") or pb.get("total_output_tokens")
        for name, path in COMPARED:
            if not tokens and path[0] in TOKEN_METRICS:
                continue  # v2: no tokens, and TTFT is the whole latency
            va, vb = get(pa, path), get(pb, path)
            if not va and not vb:
                continue
            ratio = f"{vb / va:.2f}" if va and vb is not None else "-"
            lines.append(
                f"{pa['load']:<10} {name:<12} {_cell(va, '{:.2f}'):>10} "
                f"{_cell(vb, '{:.2f}'):>10} {ratio:>7}"
            )
    return "\n".join(lines)
