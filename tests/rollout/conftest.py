"""Helpers shared by the rollout tests that run a real server."""

from __future__ import annotations

import time

import httpx


def mirrored_report(client: httpx.Client, model: str, n: int, timeout: float, every: float) -> dict:
    """The model's rollout report once `n` mirrored requests have run on its shadow
    (checked every `every` seconds), or the last one after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        report = client.get(f"/v2/models/{model}/rollout").json()
        if report["shadow_comparison"]["mirrored"] >= n or time.monotonic() >= deadline:
            return report
        time.sleep(every)
