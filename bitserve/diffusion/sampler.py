"""DDIM (and DDPM) updates for a batch of rows, each at its own timestep.

A `Row` is one image being generated: its noisy sample x, its own timestep sequence and
position in it, its label, guidance scale, eta and random generator. `denoise` runs one
network pass for any set of rows and `advance` moves each row one step down its own
sequence; nothing in either mixes rows, so a row's trajectory depends only on its
own parameters and seed, never on what it was batched with.

The update (Song et al. 2021, eq. 12), with abar = alphas_cumprod, t -> t' (t' < t):

    x0   = (x - sqrt(1 - abar_t) eps) / sqrt(abar_t), clipped to [-1, 1]
    eps  = (x - sqrt(abar_t) x0) / sqrt(1 - abar_t)          (consistent with the clip)
    sig  = eta sqrt((1 - abar_t') / (1 - abar_t)) sqrt(1 - abar_t / abar_t')
    x_t' = sqrt(abar_t') x0 + sqrt(1 - abar_t' - sig^2) eps + sig z

eta = 0 is deterministic DDIM; eta = 1 is DDPM's ancestral sampler (its posterior
variance) on the chosen timesteps. Guidance: eps = eps_u + s (eps_c - eps_u).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from bitserve.diffusion.params import GenerationParams
from bitserve.diffusion.schedule import Schedule
from bitserve.diffusion.unet import Denoiser


@dataclass(eq=False)
class Row:
    params: GenerationParams
    seed: int
    timesteps: list[int]
    x: torch.Tensor  # [1, H, W], the current sample
    generator: torch.Generator
    future: Future = field(default_factory=Future)  # the [H, W] image, or the error
    index: int = 0  # position in `timesteps`: the step this row takes next
    state: str = "waiting"  # waiting -> running -> done | cancelled
    arrival: float = field(default_factory=time.perf_counter)  # queue time counts from here

    @property
    def t(self) -> int:
        return self.timesteps[self.index]

    @property
    def t_prev(self) -> int:
        """The timestep this step lands on; -1 is the clean image (abar = 1)."""
        return self.timesteps[self.index + 1] if self.index + 1 < len(self.timesteps) else -1

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    def image(self) -> torch.Tensor:
        """The finished sample in [0, 1], [H, W] float32."""
        return self.x[0].clamp(-1, 1).add(1).div(2)


def new_row(params: GenerationParams, schedule: Schedule, size: int, seed: int) -> Row:
    """A row at pure noise x_T ~ N(0, I), drawn from the request's own generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((1, size, size), generator=generator)
    return Row(params, seed, schedule.timesteps(params.steps), x, generator)


@torch.inference_mode()
def denoise(model: Denoiser, rows: list[Row]) -> tuple[torch.Tensor, int]:
    """Guided eps for every row: the conditional and unconditional halves of all rows in
    one batch (rows that need one half run once). Returns (eps [B, 1, H, W], the number
    of unconditional passes added)."""
    null = model.config.null_label
    halves = [row.params.halves for row in rows]
    labels = torch.tensor(
        [row.params.label if cond else null for row, (cond, _) in zip(rows, halves, strict=True)]
    )
    both = torch.tensor([cond and uncond for cond, uncond in halves])
    x = torch.stack([row.x for row in rows])
    t = torch.tensor([row.t for row in rows])
    device = next(model.parameters()).device
    eps, eps_u = model.guided(x.to(device), t.to(device), labels.to(device), both.to(device))
    eps, eps_u = eps.cpu(), eps_u.cpu()  # rows (and their generators) live on the CPU
    if len(eps_u):
        idx = both.nonzero().flatten()
        scale = torch.tensor([rows[i].params.guidance_scale for i in idx.tolist()])
        eps = eps.clone()
        eps[idx] = eps_u + scale.view(-1, 1, 1, 1).float() * (eps[idx] - eps_u)
    return eps, len(eps_u)


@torch.inference_mode()
def advance(rows: list[Row], eps: torch.Tensor, abar: torch.Tensor) -> None:
    """One DDIM/DDPM update per row, each from its own t to its own t'. `abar` is
    alphas_cumprod with a 1 appended: t' = -1, the clean image, indexes that 1."""
    a_t = abar[[row.t for row in rows]].view(-1, 1, 1, 1)
    a_prev = abar[[row.t_prev for row in rows]].view(-1, 1, 1, 1)
    eta = torch.tensor([row.params.eta for row in rows], dtype=abar.dtype).view(-1, 1, 1, 1)
    x = torch.stack([row.x for row in rows]).to(abar.dtype)
    eps = eps.to(abar.dtype)
    x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
    eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
    sigma = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
    x_prev = a_prev.sqrt() * x0 + (1 - a_prev - sigma**2).clamp(min=0).sqrt() * eps
    for i, row in enumerate(rows):
        if row.params.eta > 0 and row.t_prev >= 0:
            noise = torch.randn(row.x.shape, generator=row.generator, dtype=torch.float32)
            x_prev[i] += sigma[i] * noise.to(abar.dtype)
    for row, x in zip(rows, x_prev.float().unbind(), strict=True):
        row.x = x
        row.index += 1


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, H, W] floats in [0, 1] (what a finished row holds) -> uint8 pixels."""
    return images.mul(255).round().clamp(0, 255).to(torch.uint8).numpy()
