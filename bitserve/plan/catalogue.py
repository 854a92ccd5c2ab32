"""The shipped catalogue of instance shapes (catalogue.toml), read into dataclasses."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

CATALOGUE = Path(__file__).with_name("catalogue.toml")


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "cpu" or "gpu"
    accelerators: int
    memory_gib: float  # per device
    bandwidth_gbs: float  # per device
    fp32_tflops: float
    bf16_tflops: float
    dtype: str
    price_per_hour: float | None = None
    measured: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def memory(self) -> float:
        """Bytes over all devices (one tensor-parallel replica)."""
        return self.accelerators * self.memory_gib * 2**30

    @property
    def bandwidth(self) -> float:
        return self.accelerators * self.bandwidth_gbs * 1e9

    def flops(self, dtype: str) -> float:
        peak = self.fp32_tflops if dtype == "float32" else self.bf16_tflops
        return self.accelerators * peak * 1e12


def load(path: Path = CATALOGUE) -> list[Shape]:
    with path.open("rb") as f:
        rows = tomllib.load(f)["shape"]
    return [Shape(**row) for row in rows]
