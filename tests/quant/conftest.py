"""Shared fixtures: tinylm, its held-out text, and quantized copies built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitserve.quantize.folders import resolve_source

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
TINYLM = ROOT / "models/tinylm"
HELDOUT = TINYLM / "heldout.txt"
EVAL_TOKENS = 1024  # 4 windows of 256: int8/int4 ppl changes are stable to ~0.3% here


@pytest.fixture(scope="session")
def heldout_ids() -> list[int]:
    from bitserve.quantize.scoring import text_token_ids

    return text_token_ids(TINYLM / "1", HELDOUT.read_text())


@pytest.fixture(scope="session")
def quantized_tinylm(tmp_path_factory):
    """method -> repository model folder written by the quantize command's code path."""
    from bitserve.quantize.command import _quantize_llm

    root = tmp_path_factory.mktemp("quantized")
    folders = {}
    for method, group in (("int8", 32), ("int4", 32)):
        out = root / f"tinylm-{method}"
        _quantize_llm(resolve_source(TINYLM), out, method, group, 6.0, None, 0, None)
        folders[method] = out
    return folders
