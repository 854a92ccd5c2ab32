"""The committed `models/digits` weights, loaded once; torch on one thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitserve.diffusion.engine import DiffusionEngine
from bitserve.diffusion.evaluate import weights_path
from bitserve.diffusion.unet import load_denoiser

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits"

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def denoiser():
    return load_denoiser(weights_path(DIGITS))


@pytest.fixture
def engine(denoiser) -> DiffusionEngine:
    """An engine without its thread: tests call `step` themselves."""
    model, schedule = denoiser
    return DiffusionEngine(model, schedule, max_rows=64)


def run(engine: DiffusionEngine) -> int:
    """Step until nothing is left; the number of steps taken."""
    steps = 0
    while engine.step():
        steps += 1
    return steps
