"""`bitserve eval` on the committed digits model: guidance buys adherence (measured by
the judge, which never saw generated digits) and costs diversity."""

import json

import numpy as np
from click.testing import CliRunner

from bitserve.cli import main as cli
from bitserve.diffusion.evaluate import diversity, evaluate, frechet
from tests.diffusion.conftest import DIGITS


def test_guidance_raises_adherence_over_the_unconditional_model(tmp_path):
    result = evaluate(DIGITS, samples=6, steps=20, scales=(0.0, 3.0), report=tmp_path)
    by_scale = {r["guidance_scale"]: r for r in result["scales"]}
    assert by_scale[3.0]["adherence"] >= 0.9
    assert by_scale[3.0]["adherence"] >= by_scale[0.0]["adherence"] + 0.3
    assert by_scale[0.0]["diversity"] > by_scale[3.0]["diversity"]
    assert result["real"]["judge_accuracy"] >= 0.95
    assert json.loads((tmp_path / "eval.json").read_text())["scales"] == result["scales"]
    for figure in ("grid.png", "guidance.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"


def test_bitserve_eval_dispatches_diffusion_models(tmp_path):
    out = CliRunner().invoke(
        cli, ["eval", str(DIGITS), "--samples", "1", "--report", str(tmp_path), "--json"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert [r["guidance_scale"] for r in doc["scales"]] == [0.0, 1.0, 3.0, 5.0]
    assert doc["kind"] == "diffusion" and (tmp_path / "grid.png").exists()


def test_frechet_and_diversity_measure_what_they_claim():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 4))
    assert frechet(a, a) < 1e-6
    shifted = frechet(a, a + np.array([3.0, 0, 0, 0]))
    assert abs(shifted - 9.0) < 0.5  # ||mu_a - mu_b||^2 with equal covariances
    labels = np.repeat([0, 1], 200)
    assert diversity(a * 2, labels) > 1.9 * diversity(a, labels)
