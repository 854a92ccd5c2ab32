"""The judge: a small CNN digit classifier trained on real digits only, never on the
generator's output. `bitserve eval` uses its predictions (does a generated "7" read as
a 7?) and its penultimate features (diversity, Fréchet distance)."""

from __future__ import annotations

import torch
from torch import nn


class Judge(nn.Module):
    features_dim = 64

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 4x4
            nn.Flatten(),
            nn.Linear(64 * 16, self.features_dim),
            nn.ReLU(),
        )
        self.head = nn.Linear(self.features_dim, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate activations, [B, 64], of images [B, 1, 16, 16] in [-1, 1]."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
