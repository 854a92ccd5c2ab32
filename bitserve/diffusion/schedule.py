"""The noise schedule shared by training and sampling.

Forward process: x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, t = 0..T-1, with the
linear betas of DDPM (Ho et al. 2020). A sampler that takes S < T steps walks a
subsequence of these timesteps (DDIM, Song et al. 2021); `timesteps(S)` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Schedule:
    steps: int = 1000  # T, the training timesteps
    beta_start: float = 1e-4
    beta_end: float = 0.02

    def alphas_cumprod(self) -> torch.Tensor:
        """abar_t for t = 0..T-1, float64 so that sampling arithmetic stays exact."""
        betas = torch.linspace(self.beta_start, self.beta_end, self.steps, dtype=torch.float64)
        return torch.cumprod(1.0 - betas, dim=0)

    def timesteps(self, count: int) -> list[int]:
        """`count` evenly spaced timesteps from T-1 (pure noise) down ("trailing"
        spacing: the first step starts where training's noisiest sample is)."""
        if not 1 <= count <= self.steps:
            raise ValueError(f"steps must be in 1..{self.steps}, got {count}")
        stride = self.steps / count
        return [round(self.steps - 1 - stride * i) for i in range(count)]

    def to_dict(self) -> dict:
        return {"steps": self.steps, "beta_start": self.beta_start, "beta_end": self.beta_end}
