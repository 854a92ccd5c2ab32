"""The one interface every backend implements.

A `Model` is one instance of one model version. The server calls `load` once (in a
worker thread, so a slow load never blocks the event loop), then `predict` with whole
batches: a dict from input name to a numpy array whose first dimension is the batch
(when `max_batch_size > 0`). `predict` returns a dict from output name to an array or
torch tensor with the same first dimension; the batcher slices it back per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.config import ModelConfig


class LoadError(Exception):
    """A model version that cannot load; the message names the file or the cause."""


class Model(ABC):
    #: the v2 metadata `platform` string (Triton's names where one exists)
    platform: str = "unknown"
    #: time `load` and the config's warmup requests took (set by the loader)
    load_only_seconds: float = 0.0
    warmup_seconds: float = 0.0

    def __init__(self, config: ModelConfig, version_dir: Path, device: str = "cpu"):
        self.config = config
        self.version_dir = version_dir
        self.device = device

    @abstractmethod
    def load(self) -> None:
        """Read weights and build the model; raise LoadError with a clear cause."""

    @abstractmethod
    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """Run one batch."""

    @classmethod
    def validate(cls, config: ModelConfig, inputs: dict[str, np.ndarray]) -> None:
        """Check one request before it joins a batch; raise ValueError to refuse it (400).

        A request that would make `predict` fail must be stopped here, or it would fail
        every request batched with it."""
        return None

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release what `load` took; the default drops nothing explicitly."""

    def require_file(self, *names: str) -> Path:
        """The first of `names` present in the version folder, or a LoadError naming them."""
        for name in names:
            path = self.version_dir / name
            if path.exists():
                return path
        raise LoadError(f"{self.version_dir}: no {' or '.join(names)} in the version folder")


def set_threads(count: int) -> None:
    """Apply an instance group's `threads` to torch (a process-wide setting)."""
    if count > 0:
        import torch

        torch.set_num_threads(count)
