"""Pictures of a fit: the histogram with every fitted density over it, and QQ plots.

AIC only ranks the candidates; the eye catches what a single number hides (a heavy
tail, two modes, a floor), so each fitted series gets one PNG with both views.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bitserve.plan.fit import Fit


def plot(sample: np.ndarray, fits: list[Fit], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = np.sort(np.asarray(sample, dtype=float))
    data = data[data > 0]
    fig, (hist, qq) = plt.subplots(1, 2, figsize=(11, 4))
    top = np.quantile(data, 0.995)
    hist.hist(data[data <= top], bins=60, density=True, alpha=0.4, color="grey", label="data")
    x = np.linspace(data[0], top, 400)
    for fit in fits:
        hist.plot(x, fit.frozen().pdf(x), label=f"{fit.family} (AIC {fit.aic:.0f})")
    hist.set(title=f"{title}: histogram and fitted densities", xlabel=title, ylabel="density")
    hist.legend(fontsize=8)
    probs = (np.arange(1, len(data) + 1) - 0.5) / len(data)
    for fit in fits:
        qq.plot(fit.frozen().ppf(probs), data, ".", markersize=3, label=fit.family)
    qq.plot([data[0], data[-1]], [data[0], data[-1]], "k--", linewidth=1, label="y = x")
    qq.set(title="QQ plot", xlabel="fitted quantile", ylabel="sample quantile")
    qq.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
