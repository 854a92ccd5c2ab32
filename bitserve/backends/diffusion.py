"""The `diffusion` backend: a denoiser sampled with DDIM/DDPM and classifier-free
guidance, every image's steps batched with every other's (bitserve/diffusion/engine.py).

    backend = "diffusion"
    max_batch_size = 16             # images per v2 request
    [instance_group]
    count = 16                      # v2 requests in flight at once (see below)
    [parameters]
    weights = "model.safetensors"   # in the version folder
    max_rows = 64                   # images per denoising step
    max_waiting = 1024              # images queued for a step; past it 429
    stall_timeout_s = 60            # work queued and no step this long = not live
    default_steps = 30
    default_guidance_scale = 3.0

v2 inputs (per row): `label` INT32 (0..9, -1 = unconditional), and optional
`guidance_scale` FP32, `steps` INT32, `seed` INT64, `eta` FP32; output `image` UINT8
[H, W].

All instances of one version share one engine (one step loop, one copy of the
weights): an instance is a slot through which a v2 batch enters the engine and waits
for its images, so `instance_group.count` bounds the v2 requests in flight, while the
engine merges their rows into each step. A request therefore joins the running
images at the next step instead of waiting for them to finish. With `isolation =
"process"` each instance has its own engine and rows batch only within it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bitserve.backends.base import LoadError, Model
from bitserve.config import ModelConfig
from bitserve.diffusion.engine import DiffusionEngine
from bitserve.diffusion.params import GenerationParams, InvalidParams
from bitserve.diffusion.sampler import to_uint8
from bitserve.diffusion.unet import load_denoiser

PARAMETERS = {
    "weights",
    "max_rows",
    "max_waiting",
    "stall_timeout_s",
    "default_steps",
    "default_guidance_scale",
}
ROW_INPUTS = {"guidance_scale": float, "steps": int, "seed": int, "eta": float}


class DiffusionModel(Model):
    platform = "bitserve_diffusion"

    def __init__(self, config: ModelConfig, version_dir: Path, device: str = "cpu"):
        super().__init__(config, version_dir, device)
        self.engine: DiffusionEngine | None = None
        self._key: tuple | None = None

    def load(self) -> None:
        params = self.config.parameters
        unknown = set(params) - PARAMETERS
        if unknown:
            raise LoadError(
                f"{self.version_dir.parent / 'config.toml'}: unknown diffusion parameters "
                f"{sorted(unknown)}; known: {sorted(PARAMETERS)}"
            )
        path = self.require_file(params.get("weights", "model.safetensors"))
        stat = path.stat()
        self._key = (str(path.resolve()), stat.st_mtime_ns, self.device, json.dumps(params))
        self.engine = _acquire(self._key, lambda: _build(path, params, self.device))

    def unload(self) -> None:
        if self._key is not None:
            _release(self._key)
            self._key, self.engine = None, None

    @classmethod
    def validate(cls, config: ModelConfig, inputs: dict[str, np.ndarray]) -> None:
        request_params(config, inputs)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        assert self.engine is not None
        rows = [self.engine.submit(p) for p in request_params(self.config, inputs)]
        images = [row.future.result() for row in rows]
        return {"image": to_uint8(torch.stack(images))}

    def alive(self) -> bool:
        """False when the shared step loop died or stalled: the watchdog then restarts
        this instance, and its fresh load builds a new engine (`_acquire`)."""
        return engine_problem(self.engine, self.config) is None


def request_params(config: ModelConfig, inputs: dict[str, np.ndarray]) -> list[GenerationParams]:
    """One GenerationParams per row of a v2 batch; InvalidParams names the field."""
    if "label" not in inputs:
        raise InvalidParams("input 'label' is required (0..9, or -1 for unconditional)")
    labels = inputs["label"].reshape(len(inputs["label"]), -1)
    if labels.shape[1] != 1:
        raise InvalidParams("input 'label' takes one value per row")
    base = defaults(config)
    columns = {
        name: (kind, inputs[name].reshape(len(labels), -1)[:, 0])
        for name, kind in ROW_INPUTS.items()
        if name in inputs
    }
    out = []
    for i in range(len(labels)):
        label = int(labels[i, 0])
        fields = {**base, **{name: kind(column[i]) for name, (kind, column) in columns.items()}}
        params = GenerationParams(label=None if label == -1 else label, **fields)
        out.append(params.check())
    return out


def defaults(config: ModelConfig) -> dict[str, Any]:
    p = config.parameters
    return {
        "steps": int(p.get("default_steps", 30)),
        "guidance_scale": float(p.get("default_guidance_scale", 3.0)),
    }


def engine_problem(engine: DiffusionEngine | None, config: ModelConfig | None) -> str | None:
    """Why an engine cannot answer: its loop died, or work waits and no step ran for
    `stall_timeout_s` (None when healthy)."""
    if engine is None:
        return None
    if engine.error is not None or not engine.alive():
        return f"diffusion engine loop died: {engine.error!r}"
    silent = time.monotonic() - engine.last_progress
    limit = float(config.parameters.get("stall_timeout_s", 60.0)) if config else 60.0
    if engine.pending and silent > limit:
        return f"diffusion engine stalled: no step for {silent:.0f} s with work queued"
    return None


def _build(path: Path, params: dict, device: str) -> DiffusionEngine:
    try:
        model, schedule = load_denoiser(path)
    except Exception as e:
        raise LoadError(f"{path}: cannot load the denoiser: {e}") from e
    engine = DiffusionEngine(
        model.to(device),
        schedule,
        max_rows=int(params.get("max_rows", 64)),
        max_waiting=int(params.get("max_waiting", 1024)),
    )
    return engine.start()


# One engine per loaded weights file, shared by the instances of a version.
_ENGINES: dict[tuple, list] = {}  # key -> [engine, references]
_LOCK = threading.Lock()


def _acquire(key: tuple, build: Any) -> DiffusionEngine:
    with _LOCK:
        if key in _ENGINES and engine_problem(_ENGINES[key][0], None) is not None:
            del _ENGINES[key]  # dead or stalled: its instances are being replaced
        if key not in _ENGINES:
            _ENGINES[key] = [build(), 0]
        _ENGINES[key][1] += 1
        return _ENGINES[key][0]


def _release(key: tuple) -> None:
    with _LOCK:
        entry = _ENGINES.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _ENGINES[key]
    entry[0].stop()


BACKEND = DiffusionModel
