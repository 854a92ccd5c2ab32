"""Detector weights as safetensors: the tensors plus the widths that shape them.

A pruned or distilled network differs from the teacher only in its widths, which the
file's metadata records, so loading never needs pickle (DESIGN: never unpickle)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from bitserve.vision import net


def save(model: net.CenterNet, path: Path, **meta) -> None:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "widths": json.dumps(list(model.widths)),
        **{k: json.dumps(v) for k, v in meta.items()},
    }
    save_file(state, str(path), metadata=metadata)


def load(path: Path) -> net.CenterNet:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        widths = json.loads(f.metadata()["widths"])
    model = net.CenterNet(tuple(widths))
    model.load_state_dict(load_file(str(path)))
    return model.eval()
