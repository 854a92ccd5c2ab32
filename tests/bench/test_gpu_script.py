"""bench/gpu.py's dry run (`--cpu`): every section runs through on the CPU (issue 39)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_gpu_dry_run_completes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--cpu", "--out", str(out), "--budget", "900"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=1200,
    )
    result = json.loads(out.read_text())
    for section in ("environment", "ceilings", "parity", "features", "engine", "served"):
        assert "error" not in result[section] and "skipped" not in result[section], section
    assert result["parity"]["all_fp32_exact"], result["parity"]
    assert all(v.get("ok", True) for v in result["features"].values() if isinstance(v, dict))
    assert result["served"]["c1"]["failed"] == 0
