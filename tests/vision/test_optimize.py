"""`bitserve optimize` end to end on the committed teacher (int8 and pruning only, a few
fine-tune steps): the report, the versions it writes, and that each serves."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from bitserve.cli import main
from bitserve.config import load_config
from bitserve.vision import data
from bitserve.vision.backend import DetectorModel
from bitserve.vision.optimize import report

from .conftest import DETECTOR


@pytest.fixture(scope="module")
def optimized(tmp_path_factory, detector_graphs):
    folder = tmp_path_factory.mktemp("opt") / "detector"
    folder.mkdir()
    for name in ("config.toml", "teacher.safetensors"):
        shutil.copyfile(DETECTOR / name, folder / name)
    (folder / "1").mkdir()
    shutil.copyfile(detector_graphs["teacher"], folder / "1" / "model.onnx")
    args = ["optimize", str(folder), "--techniques", "int8,prune", "--prune-steps", "2"]
    result = CliRunner().invoke(main, [*args, "--heldout", "40", "--rounds", "5"])
    assert result.exit_code == 0, result.output
    return folder, json.loads((folder / "optimize" / "report.json").read_text()), result.output


def test_report_has_every_figure_and_the_plot(optimized):
    folder, doc, output = optimized
    rows = {r["name"]: r for r in doc["variants"]}
    assert set(rows) == {"teacher", "int8", "pruned"}
    for row in rows.values():
        for key in ("map", "map50", "p50_ms", "p95_ms", "throughput_b8", "size_kb", "speedup"):
            assert row[key] >= 0, (row["name"], key)
    assert rows["teacher"]["map50"] >= 0.9  # the committed teacher on 40 held-out canvases
    assert abs(rows["int8"]["delta_points"]) < 2.0  # calibrated int8 keeps the accuracy
    # pruning removed channels: a quarter of the weights (half the inputs, half the outputs)
    assert rows["pruned"]["size_kb"] < 0.35 * rows["teacher"]["size_kb"]
    assert rows["pruned"]["train_minutes"] > 0
    assert (folder / "optimize" / "pareto.png").stat().st_size > 10_000
    assert "| int8 |" in output and "best combination:" in output


def test_each_variant_is_a_servable_version(optimized):
    folder, doc, _ = optimized
    assert doc["versions"] == {"int8": 2, "pruned": 3}
    config = load_config(folder / "config.toml")
    image = data.heldout(1)[0].image[None, ..., None]
    for number in (2, 3):
        assert json.loads((folder / str(number) / "variant.json").read_text())["name"]
        model = DetectorModel(config, folder / str(number))
        model.load()
        out = model.predict({"image": image})
        assert out["boxes"].shape == (1, 20, 4) and out["num_detections"].shape == (1, 1)


def test_pareto_front_keeps_what_nothing_beats():
    table = [
        {"name": "slow-good", "p50_ms": 10.0, "map": 0.8},
        {"name": "fast-bad", "p50_ms": 1.0, "map": 0.5},
        {"name": "beaten", "p50_ms": 5.0, "map": 0.4},
        {"name": "middle", "p50_ms": 4.0, "map": 0.7},
    ]
    assert report.pareto(table) == {"slow-good", "fast-bad", "middle"}


def test_unknown_technique_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["optimize", str(DETECTOR), "--techniques", "magic"])
    assert result.exit_code == 2 and "unknown techniques ['magic']" in result.output
