"""The activation profiler: per input channel of every linear layer, the largest |x| seen.

A calibration pass runs sample text through the full-precision model with a forward
pre-hook on each `nn.Linear`. Channels whose absmax exceeds the threshold (6.0, as
bitsandbytes' LLM.int8()) are the outliers that int8-outlier keeps in fp32; the report
prints, per layer, how many there are and how large, and plots them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bitserve.llm.quant.quantize import quantizable
from bitserve.quantize.scoring import text_token_ids, window_logits, windows


@dataclass
class LayerProfile:
    name: str
    absmax: torch.Tensor  # [in_features]: the largest |activation| per input channel

    def outliers(self, threshold: float) -> torch.Tensor:
        return torch.nonzero(self.absmax > threshold).flatten()


def profile_activations(
    model: nn.Module, token_ids: list[int], window: int = 256, max_tokens: int = 4096
) -> dict[str, LayerProfile]:
    """Run the text through `model`; absmax per input channel of each linear layer."""
    profiles: dict[str, LayerProfile] = {}

    def hook(name: str):
        def record(_module, inputs) -> None:
            x = inputs[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu()
            if name in profiles:
                torch.maximum(profiles[name].absmax, amax, out=profiles[name].absmax)
            else:
                profiles[name] = LayerProfile(name, amax)

        return record

    handles = [
        linear.register_forward_pre_hook(hook(name)) for name, linear in quantizable(model).items()
    ]
    try:
        for chunk in windows(token_ids, window, max_tokens):
            window_logits(model, chunk)
    finally:
        for handle in handles:
            handle.remove()
    return profiles


def calibrate_folder(
    folder: Path, text: str, window: int = 256, max_tokens: int = 4096
) -> tuple[nn.Module, dict[str, LayerProfile]]:
    """Load the full-precision model in `folder` and profile it on `text`."""
    from bitserve.llm.config import EngineConfig
    from bitserve.llm.models import load_model

    config = EngineConfig(model=folder, device="cpu", num_kv_blocks=1)
    model = load_model(config)
    window = min(window, config.max_model_len)
    return model, profile_activations(model, text_token_ids(config.model, text), window, max_tokens)


def report(profiles: dict[str, LayerProfile], threshold: float, top: int = 4) -> str:
    """Per layer: channels over the threshold, the largest of them, and the layer's max."""
    lines = [
        f"activation outliers (|x| > {threshold:g}) per linear layer, by input channel",
        f"{'layer':<40} {'channels':>8} {'over':>5} {'max |x|':>9}  "
        "largest outliers (channel: |x|)",
    ]
    total = 0
    for p in profiles.values():
        idx = p.outliers(threshold)
        total += len(idx)
        order = idx[p.absmax[idx].argsort(descending=True)][:top]
        largest = ", ".join(f"{int(c)}: {float(p.absmax[c]):.1f}" for c in order)
        peak = float(p.absmax.max())
        lines.append(f"{p.name:<40} {len(p.absmax):>8} {len(idx):>5} {peak:>9.2f}  {largest}")
    channels = sum(len(p.absmax) for p in profiles.values())
    lines.append(
        f"{total} of {channels} input channels over {threshold:g} across {len(profiles)} layers"
    )
    return "\n".join(lines)


def plot(profiles: dict[str, LayerProfile], threshold: float, path: Path) -> Path:
    """Two panels: outlier count per layer; every channel's absmax per layer (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(profiles)
    counts = [len(profiles[n].outliers(threshold)) for n in names]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(names) * 0.3), 8), sharex=True)
    top.bar(range(len(names)), counts, color="tab:red")
    top.set_ylabel(f"channels with |x| > {threshold:g}")
    top.set_title("activation outliers per linear layer (calibration pass)")
    for i, n in enumerate(names):
        amax = profiles[n].absmax.clamp(min=1e-6)
        bottom.scatter([i] * len(amax), amax, s=2, alpha=0.4, color="tab:blue")
    bottom.axhline(threshold, color="tab:red", linestyle="--", label=f"threshold {threshold:g}")
    bottom.set_yscale("log")
    bottom.set_ylabel("per-channel max |x|")
    bottom.legend(loc="upper left")
    bottom.set_xticks(range(len(names)))
    bottom.set_xticklabels(names, rotation=90, fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
