"""`bitserve quantize` and `bitserve eval` as a user runs them."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bitserve.quantize.command import evaluate, quantize
from tests.quant.conftest import HELDOUT, TINYLM


def run(command, *args: str):
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_profile_prints_the_outlier_report_and_writes_a_png(tmp_path) -> None:
    text = tmp_path / "sample.txt"
    text.write_text(HELDOUT.read_text()[:20000])
    plot = tmp_path / "outliers.png"
    result = run(quantize, "--profile", TINYLM, "--calibration", text, "--plot", plot)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("activation outliers (|x| > 6)")
    down = next(line for line in lines if line.startswith("layers.0.mlp.down_proj "))
    assert int(down.split()[2]) > 0  # tinylm's down_proj inputs carry outliers
    assert "input channels over 6 across 33 layers" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_outlier_method_needs_calibration_text(tmp_path) -> None:
    result = CliRunner().invoke(
        quantize, [str(TINYLM), str(tmp_path / "out"), "--method", "int8-outlier"]
    )
    assert result.exit_code != 0 and "--calibration" in result.output


def test_a_bare_folder_in_a_bare_folder_out_and_eval_side_by_side(tmp_path) -> None:
    out = tmp_path / "tinylm-int8"
    run(quantize, TINYLM / "1", out, "--method", "int8")
    assert (out / "config.json").is_file() and not (out / "config.toml").exists()
    result = run(evaluate, out, "--against", TINYLM, "--text", HELDOUT, "--max-tokens", 512)
    table, last = result.stdout.splitlines()[:-1], result.stdout.splitlines()[-1]
    assert table[0].split() == ["model", "reference"]
    assert any(line.startswith("perplexity_change") for line in table)
    report = json.loads(last)
    assert report["reference"]["folder"].endswith("tinylm/1")  # a repository folder resolves
    assert abs(report["comparison"]["perplexity_change"]) < 0.01
    assert report["model"]["decode_tok_s"] > 0 and report["comparison"]["memory_ratio"] < 0.27
