"""`bitserve optimize MODEL_DIR --data COCO_DIR` on a detector bitserve did not train: a
small YOLO-style network built and trained here for about a minute (tests/vision/yolo.py),
scored by pycocotools on a COCO folder, each variant then served through tritonclient.
The decoders are checked against graphs whose answer is known (the bundled detector's
own post-NMS graph, and its raw CenterNet heads), and bad input against its message."""

from __future__ import annotations

import json
import shutil
import tomllib

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from click.testing import CliRunner

from bitserve.cli import main
from bitserve.vision import coco, data, evaluate, graph, net, weights
from tests.conftest import Server

from . import yolo
from .conftest import DETECTOR

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def yolo_graph(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("yolo")
    return yolo.export(yolo.train(seconds=60), folder / "yolo.onnx")


@pytest.fixture(scope="module")
def untrained_graph(tmp_path_factory):
    """For the refusals: they are decided before a box is scored, so no training."""
    torch.manual_seed(0)
    return yolo.export(yolo.Yolo(), tmp_path_factory.mktemp("yolo0") / "yolo.onnx")


@pytest.fixture(scope="module")
def coco_dir(tmp_path_factory):
    return yolo.coco_folder(tmp_path_factory.mktemp("coco") / "val", count=60)


def _model(tmp_path, graph_path, config=yolo.CONFIG):
    folder = tmp_path / "models" / "yolo"
    yolo.repository_model(folder, graph_path)
    (folder / "config.toml").write_text(config)
    return folder


@pytest.fixture(scope="module")
def optimized(tmp_path_factory, yolo_graph, coco_dir):
    folder = _model(tmp_path_factory.mktemp("repo"), yolo_graph)
    args = ["optimize", str(folder), "--data", str(coco_dir), "--rounds", "20"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return folder, json.loads((folder / "optimize" / "report.json").read_text()), result.output


@pytest.mark.slow  # a minute of training and 20 timing rounds of each variant: make test-all
def test_every_technique_that_applies_runs_and_reports(optimized):
    folder, doc, output = optimized
    rows = {r["name"]: r for r in doc["variants"]}
    expected = {"original", "ort-disabled", "ort-basic", "ort-extended", "res96", "res64"}
    assert expected <= set(rows)
    int8 = [name for name in rows if name.startswith("int8") and "res" not in name]
    assert int8 and any(name.endswith("-res96") for name in rows)
    for row in rows.values():
        for key in ("map", "map50", "p50_ms", "p95_ms", "throughput_b8", "speedup"):
            assert row[key] >= 0, (row["name"], key)
    assert rows["original"]["map50"] > 0.1  # a minute of training found digits
    # an optimisation level changes how the graph runs, not what it computes
    assert abs(rows["ort-disabled"]["map"] - rows["original"]["map"]) < 0.002
    # the int8 variant kept is within the budget (1 point) or kept operators in FP32 trying
    last = rows[int8[-1]]
    assert last["delta_points"] >= -1.0 or len(int8) == 4
    assert doc["not_applied"].keys() == {"prune", "distill"}
    sensitivity = doc["int8_sensitivity"]
    assert len(sensitivity) == 11 and all(s["op"] == "Conv" for s in sensitivity)
    assert [s["db_lost"] for s in sensitivity] == sorted(
        (s["db_lost"] for s in sensitivity), reverse=True
    )
    assert {r["instances"] for r in doc["layout"]} == {1, 2}
    assert set(doc["batching"]["original"]) == {"1", "2", "4", "8", "16"}
    assert (folder / "optimize" / "pareto.png").stat().st_size > 10_000
    assert "| int8" in (folder / "optimize" / "report.md").read_text()
    assert "best combination:" in output


@pytest.mark.slow
def test_each_variant_serves_as_a_version_through_tritonclient(optimized, coco_dir):
    folder, doc, _ = optimized
    versions = doc["versions"]
    assert sorted(versions.values()) == list(range(2, 2 + len(versions)))
    config = folder / "config.toml"
    config.write_text(config.read_text() + "\n[version_policy]\nall = true\n")
    canvases = data.heldout(4)
    server = Server(folder.parent)
    try:
        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        for version in ["1", *map(str, versions.values())]:
            for canvas in canvases:
                image = canvas.image[None, ..., None]
                tensor = triton.InferInput("image", list(image.shape), "UINT8")
                tensor.set_data_from_numpy(image)
                result = client.infer("yolo", [tensor], model_version=version)
                assert result.as_numpy("boxes").shape == (1, 20, 4)
                n = int(result.as_numpy("num_detections")[0, 0])
                assert 0 <= n <= 20
                assert np.all(result.as_numpy("classes")[0, n:] == -1)
        client.close()
    finally:
        server.stop()


def test_decoder_none_matches_the_bundled_graph(detector_graphs, tmp_path):
    """The bundled detector's graph is post-NMS (uint8 NHWC in, boxes in image pixels
    out): declared with decoder "none" it scores what evaluate.mean_ap gives it."""
    import onnxruntime as ort

    canvases = data.heldout(40)
    folder = coco.write(
        tmp_path / "set",
        [c.image for c in canvases],
        [c.boxes for c in canvases],
        [c.labels for c in canvases],
    ).parent
    declared = {
        "preprocess": {
            "size": [128, 128],
            "resize": "stretch",
            "channels": "grey",
            "layout": "nhwc",
            "dtype": "uint8",
        },
        "outputs": {"decoder": "none", "boxes": "boxes", "scores": "scores", "classes": "classes"},
    }
    detector = graph.Detector.from_config(detector_graphs["teacher"], declared, "test")
    found = coco.load(folder)
    got = coco.mean_ap(
        found, {i: detector([found.image(i)])[0] for i in found.image_ids}, found.category_ids
    )
    session = ort.InferenceSession(str(detector_graphs["teacher"]))
    want = evaluate.mean_ap(evaluate.session_detect(session), canvases)
    assert got["map"] == pytest.approx(want["map"], abs=0.005)


def test_decoder_centernet_reads_raw_heads(tmp_path):
    """The bundled network without its peak picking: heatmap logits and regression."""
    model = weights.load(DETECTOR / "teacher.safetensors")
    path = tmp_path / "heads.onnx"
    torch.onnx.export(
        model,
        (torch.zeros(1, 1, 128, 128),),
        str(path),
        input_names=["x"],
        output_names=["heatmap", "regression"],
        dynamic_axes={"x": {0: "batch"}, "heatmap": {0: "batch"}, "regression": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    declared = {
        "preprocess": {"size": [128, 128], "resize": "stretch", "channels": "grey"},
        "outputs": {
            "decoder": "centernet",
            "heatmap": "heatmap",
            "regression": "regression",
            "stride": net.STRIDE,
        },
    }
    detector = graph.Detector.from_config(path, declared, "test")
    canvases = data.heldout(40)
    deployed = net.Deployed(model, 128).eval()

    def reference(images):
        with torch.no_grad():
            return tuple(t.numpy() for t in deployed(torch.from_numpy(images[..., None])))

    def declared_run(images):
        found = detector(list(images))
        return tuple(np.stack([f[k] for f in found]) for k in range(3))

    want = evaluate.mean_ap(reference, canvases)
    got = evaluate.mean_ap(declared_run, canvases)
    assert got["map50"] >= 0.9 and got["map"] == pytest.approx(want["map"], abs=0.01)


def _refused(folder, *args):
    before = sorted(p.name for p in folder.iterdir())
    result = CliRunner().invoke(main, ["optimize", str(folder), *args])
    assert result.exit_code == 2, result.output
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
    return result.output


def test_malformed_coco_file_names_the_file_and_the_field(tmp_path, untrained_graph, coco_dir):
    folder = _model(tmp_path, untrained_graph)
    bad = tmp_path / "bad"
    shutil.copytree(coco_dir, bad)
    doc = json.loads((bad / "instances_val.json").read_text())
    doc["annotations"][3]["bbox"] = [1, 2, 3]
    (bad / "instances_val.json").write_text(json.dumps(doc))
    output = _refused(folder, "--data", str(bad))
    assert "instances_val.json" in output and "annotations[3].bbox" in output
    (bad / "instances_val.json").write_text("{not json")
    assert "not a JSON file" in _refused(folder, "--data", str(bad))


def test_unmappable_outputs_name_the_config_and_the_field(tmp_path, untrained_graph, coco_dir):
    config = yolo.CONFIG.replace('output = "predictions"', 'output = "detections"')
    folder = _model(tmp_path, untrained_graph, config)
    output = _refused(folder, "--data", str(coco_dir))
    assert "parameters.outputs.output" in output and "'detections'" in output
    config = yolo.CONFIG.replace('decoder = "yolo"', 'decoder = "centernet"')
    output = _refused(_model(tmp_path / "b", untrained_graph, config), "--data", str(coco_dir))
    assert "config.toml" in output and "parameters.outputs.heatmap: missing" in output


def test_calibration_of_the_wrong_shape_names_the_file_and_the_field(
    tmp_path, untrained_graph, coco_dir
):
    folder = _model(tmp_path, untrained_graph)
    wrong = tmp_path / "calibration.npy"
    np.save(wrong, np.zeros((4, 3, 64, 64), np.float32))
    output = _refused(folder, "--data", str(coco_dir), "--calibration", str(wrong))
    assert str(wrong) in output and "shape: [4, 3, 64, 64] is not [N, 1, 128, 128]" in output


def test_the_declaration_parses_as_the_config_says():
    declared = tomllib.loads(yolo.CONFIG)["parameters"]
    pre = graph.Preprocess.parse(declared["preprocess"], "x")
    x, maps = pre([np.full((64, 32, 3), 200, np.uint8)])  # letterbox: 2x, padded left/right
    assert x.shape == (1, 1, 128, 128) and maps[0].tolist() == [2.0, 2.0, 32.0, 0.0]
    assert x[0, 0, 0, 0] == pytest.approx(114 / 255) and x[0, 0, 64, 64] == pytest.approx(200 / 255)
    with pytest.raises(graph.GraphError, match=r"parameters\.preprocess\.resize: 'crop'"):
        graph.Preprocess.parse({**declared["preprocess"], "resize": "crop"}, "x")
