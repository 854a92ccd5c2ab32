"""`bitserve optimize MODEL_DIR --data COCO_DIR`: speed up a detector bitserve did not train.

MODEL_DIR is a repository model whose lowest version holds `model.onnx` and whose
config declares the graph (`bitserve.vision.graph`: preprocess and outputs). Only the
techniques that need no training code apply:

- `int8`: onnxruntime QDQ static quantization, calibrated on images of the user's set
  (or `--calibration`: a folder of images or a .npy of graph inputs), per-channel int8
  weights, uint8 activations. Every Conv/MatMul/Gemm's sensitivity is measured (the
  dB of signal-to-quantization-noise its int8 version loses against the FP32 graph on
  the calibration images) and listed; when int8 loses more than `max_points_lost` mAP
  points, the most sensitive operators are kept in FP32 (1, 2, 4 of them) until it
  does not. The Conv that reads the graph input stays FP32 (raw pixels, few channels).
- `onnx`: onnxruntime's graph optimisation levels (disabled, basic, extended; the
  baseline runs at `all`, onnxruntime's default).
- `resolution`: 3/4 and 1/2 of the declared input size (multiples of 32), where the
  graph takes dynamic sizes.
- `combo`: int8 at each lower resolution.
- `layout` and `batching`: threads per instance and instances (wall time, two cores),
  images per CPU-second at batch 1..16; the report recommends, the config decides.

Pruning and distillation need the detector's training code: they apply to the bundled
one (`bitserve optimize models/detector`) and the report lists them as not applied.
Everything is checked before anything is written (a bad COCO file, an output that
cannot be mapped, calibration data of the wrong shape); then each variant is written
as the next version (`model.onnx` and `variant.json`, which the `detector` backend
reads for the variant's input size and optimisation level).
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bitserve.vision import coco, graph
from bitserve.vision.optimize import measure, report

TECHNIQUES = ("int8", "onnx", "resolution", "combo", "layout", "batching")
NOT_APPLIED = {
    "prune": "needs the detector's training code (the bundled detector has it)",
    "distill": "needs the detector's training code (the bundled detector has it)",
}


@dataclass
class GraphOptimizeConfig:
    model_dir: Path
    data: Path
    techniques: tuple[str, ...] = TECHNIQUES
    report_dir: Path | None = None
    write_versions: bool = True
    calibration: Path | None = None
    calibration_count: int = 32
    rounds: int = 100
    max_points_lost: float = 1.0

    def __post_init__(self) -> None:
        unknown = set(self.techniques) - set(TECHNIQUES) - set(NOT_APPLIED)
        if unknown:
            raise ValueError(f"unknown techniques {sorted(unknown)}; choose from {TECHNIQUES}")
        self.report_dir = self.report_dir or self.model_dir / "optimize"


@dataclass
class Candidate:
    name: str
    techniques: list[str]
    path: Path
    detector: graph.Detector
    level: str = "all"
    kept_fp32: list[str] = field(default_factory=list)


def prepare(config: GraphOptimizeConfig):
    """Every check, nothing written: (detector, versions path, COCO set, images,
    calibration inputs, category ids)."""
    from bitserve.config import load_config

    config_file = config.model_dir / "config.toml"
    model_config = load_config(config_file)
    versions = sorted(
        int(p.name) for p in config.model_dir.iterdir() if p.name.isdigit() and p.is_dir()
    )
    original = next(
        (config.model_dir / str(v) / "model.onnx" for v in versions if _has_graph(config, v)),
        None,
    )
    if original is None:
        raise graph.GraphError(f"{config.model_dir}: no version holds a model.onnx")
    detector = graph.Detector.from_config(original, model_config.parameters, str(config_file))
    data = coco.load(config.data)
    ids = detector.outputs.category_ids or tuple(data.category_ids)
    images = {i: data.image(i) for i in data.image_ids}
    calibration = calibration_inputs(config, detector, data, images)
    return detector, data, images, calibration, list(ids)


def _has_graph(config, version: int) -> bool:
    return (config.model_dir / str(version) / "model.onnx").is_file()


def calibration_inputs(config, detector: graph.Detector, data, images) -> np.ndarray:
    """Graph inputs for int8 calibration: the first images of the set, a folder of
    images, or a .npy array already in the graph's input shape."""
    pre = detector.preprocess
    if config.calibration is None:
        chosen = data.image_ids[: config.calibration_count]
        return pre([images[i] for i in chosen])[0]
    path = Path(config.calibration)
    if path.is_dir():
        from PIL import Image

        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        if not files:
            raise graph.GraphError(f"{path}: files: no .png or .jpg images to calibrate on")
        return pre([np.asarray(Image.open(f).convert("RGB")) for f in files])[0]
    if path.suffix != ".npy" or not path.is_file():
        raise graph.GraphError(f"{path}: not a folder of images or a .npy file")
    array = np.load(path, allow_pickle=False)
    want = pre([np.zeros((*pre.size, 3), np.uint8)])[0].shape[1:]
    if array.ndim != len(want) + 1 or tuple(array.shape[1:]) != tuple(want):
        raise graph.GraphError(
            f"{path}: shape: {list(array.shape)} is not [N, {', '.join(map(str, want))}], "
            f"the graph input parameters.preprocess declares ({pre.layout}, size {list(pre.size)})"
        )
    if array.dtype != np.dtype(pre.dtype):
        raise graph.GraphError(f"{path}: dtype: {array.dtype} is not {pre.dtype}")
    return array


def quantize(fp32: Path, out: Path, calibration: np.ndarray, input_name: str, exclude) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter({input_name: x[None]} for x in calibration)

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    quantize_static(
        str(fp32),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["Conv", "MatMul", "Gemm", "Relu", "Clip"],
        nodes_to_exclude=list(exclude),
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return out


def prepared_graph(original: Path, folder: Path) -> tuple[Path, list, str]:
    """onnxruntime's pre-processing (shape inference, folding) once; the quantizable
    nodes in order and the Conv that reads the graph input."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = folder / "original.prep.onnx"
    quant_pre_process(str(original), str(prepared), skip_symbolic_shape=True)
    model = onnx.load(str(prepared))
    inputs = {i.name for i in model.graph.input}
    nodes = [n for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")]
    first = next((n.name for n in nodes if n.input[0] in inputs), "")
    return prepared, nodes, first


def sensitivity(prepared: Path, int8: Path, nodes, calibration, input_name, folder) -> list:
    """[(node name, op, dB lost)] most sensitive first: per operator, the SQNR of its
    input minus the SQNR of its output (after its activation, which the quantizer may
    fold into it), the int8 graph against the FP32 one on calibration inputs."""
    import onnx

    models = {"fp32": onnx.load(str(prepared)), "int8": onnx.load(str(int8))}

    def after_activation(model, name: str) -> str:
        """The tensor after the node's Relu/Clip. In the int8 graph the quantizer drops a
        Relu whose QuantizeLinear clamps at zero anyway: there it is the DQ's output."""
        seen = current = name
        for _ in range(3):
            users = [n for n in model.graph.node if current in n.input]
            if len(users) != 1:
                break
            if users[0].op_type in ("Relu", "Clip"):
                return users[0].output[0]
            if users[0].op_type not in ("QuantizeLinear", "DequantizeLinear"):
                break
            current = users[0].output[0]
            if users[0].op_type == "DequantizeLinear":
                seen = current
        return seen

    quantized = {n.name: n for n in models["int8"].graph.node}
    pairs = []  # node, {graph: (input tensor, output tensor)}
    for node in nodes:
        q = quantized.get(node.name)
        if q is None:
            continue
        pairs.append(
            (
                node,
                {
                    "fp32": (node.input[0], after_activation(models["fp32"], node.output[0])),
                    "int8": (q.input[0], after_activation(models["int8"], q.output[0])),
                },
            )
        )
    runs = {}
    for label, model in models.items():
        names = {t for _, tensors in pairs for t in tensors[label]} - {input_name}
        existing = {o.name for o in model.graph.output}
        for name in sorted(names - existing):
            model.graph.output.append(onnx.ValueInfoProto(name=name))
        probe = folder / f"{label}.probe.onnx"
        onnx.save(model, str(probe))
        session = graph.open_session(probe, level="disabled")
        wanted = [o.name for o in session.get_outputs()]
        outs = [
            dict(zip(wanted, session.run(None, {input_name: x[None]}), strict=True))
            for x in calibration[:8]
        ]
        outs = [{**o, input_name: x[None]} for o, x in zip(outs, calibration, strict=False)]
        runs[label] = {
            n: np.concatenate([o[n].ravel() for o in outs]) for n in [*wanted, input_name]
        }
        probe.unlink()

    def sqnr(tensors: dict, side: int) -> float:
        ref = runs["fp32"][tensors["fp32"][side]].astype(np.float64)
        got = runs["int8"][tensors["int8"][side]].astype(np.float64)
        noise = float(np.sum((ref - got) ** 2))
        return 100.0 if noise == 0 else min(100.0, 10 * math.log10(np.sum(ref**2) / noise))

    table = [
        (n.name, n.op_type, round(sqnr(t, 0) - sqnr(t, 1), 2), round(sqnr(t, 1), 2))
        for n, t in pairs
    ]
    return sorted(table, key=lambda row: -row[2])


def optimize_graph(config: GraphOptimizeConfig, log=print) -> dict:
    detector, data, images, calibration, category_ids = prepare(config)
    chosen = set(config.techniques)
    ids = data.image_ids

    def score(det: graph.Detector) -> dict:
        found = {}
        for start in range(0, len(ids), 8):
            chunk = ids[start : start + 8]
            found.update(zip(chunk, det([images[i] for i in chunk]), strict=True))
        return coco.mean_ap(data, found, category_ids)

    original = Candidate("original", ["none"], detector.path, detector)
    accuracy = {"original": score(detector)}
    log(
        f"original: mAP {accuracy['original']['map']:.3f}, mAP@.5 "
        f"{accuracy['original']['map50']:.3f} on {len(ids)} images of {data.file}"
    )
    folder = config.report_dir / "graphs"
    folder.mkdir(parents=True, exist_ok=True)
    candidates = [original]
    pre = detector.preprocess

    def variant(name, techs, path, size=None, level="all", kept=()) -> Candidate:
        p = replace(pre, size=size) if size else pre
        session = graph.open_session(path, level=level)
        return Candidate(
            name, techs, path, graph.Detector(path, p, detector.outputs, session), level, list(kept)
        )

    if "onnx" in chosen:
        for level in ("disabled", "basic", "extended"):
            candidates.append(variant(f"ort-{level}", ["onnx"], detector.path, level=level))
    sizes = []
    if "resolution" in chosen or "combo" in chosen:
        for fraction in (0.75, 0.5):
            size = tuple(max(32, round(s * fraction / 32) * 32) for s in pre.size)
            try:
                trial = variant(f"res{size[0]}", ["resolution"], detector.path, size)
            except graph.GraphError as e:
                log(f"resolution {list(size)}: not applied ({e})")
                continue
            sizes.append(size)
            if "resolution" in chosen:
                candidates.append(trial)
    int8_rows, table_sens = [], []
    if "int8" in chosen or "combo" in chosen:
        prepared, nodes, first = prepared_graph(detector.path, folder)
        int8 = quantize(prepared, folder / "int8.onnx", calibration, detector.input, [first])
        table_sens = sensitivity(prepared, int8, nodes, calibration, detector.input, folder)
        log(
            "int8 sensitivity (dB lost per operator): "
            + ", ".join(f"{row[0]} {row[2]:+.1f}" for row in table_sens[:6])
        )
        best = variant("int8", ["int8"], int8, kept=[first])
        accuracy["int8"] = score(best.detector)
        int8_rows.append(best)
        ranked = [row[0] for row in table_sens if row[0] != first]
        for keep in (1, 2, 4):
            lost = 100 * (accuracy["original"]["map"] - accuracy[best.name]["map"])
            if lost <= config.max_points_lost or keep > len(ranked):
                break
            kept = [first, *ranked[:keep]]
            path = quantize(
                prepared, folder / f"int8-fp32x{keep}.onnx", calibration, detector.input, kept
            )
            best = variant(f"int8-fp32x{keep}", ["int8"], path, kept=kept)
            accuracy[best.name] = score(best.detector)
            int8_rows.append(best)
        if "int8" in chosen:
            candidates += int8_rows
        if "combo" in chosen:
            for size in sizes:
                candidates.append(
                    variant(
                        f"{best.name}-res{size[0]}",
                        ["int8", "resolution"],
                        best.path,
                        size,
                        kept=best.kept_fp32,
                    )
                )
        prepared.unlink()
    log(f"mAP of {len(candidates)} variants on {len(ids)} images")
    for c in candidates:
        if c.name not in accuracy:
            accuracy[c.name] = score(c.detector)
    variants = [_measured(c, accuracy[c.name]) for c in candidates]
    feeds = {c.name: c.detector.preprocess([images[i] for i in ids[:64]])[0] for c in candidates}
    log(f"timing: {config.rounds} interleaved rounds")
    measure.speed(variants, feeds, config.rounds)
    table = report.rows(variants, "original")
    fine = [r for r in table if r["delta_points"] >= -config.max_points_lost]
    best_name = max(fine, key=lambda r: r["speedup"])["name"]
    by_name = {c.name: c for c in candidates}
    extra = {
        "baseline": "original",
        "best": best_name,
        "max_points_lost": config.max_points_lost,
        "data": str(data.file),
        "images": len(ids),
        "calibration": str(config.calibration or f"the first {len(calibration)} images of the set"),
        "applied": sorted(chosen - set(NOT_APPLIED)),
        "not_applied": NOT_APPLIED,
        "int8_sensitivity": [
            {"node": n, "op": op, "db_lost": db, "sqnr_db": out} for n, op, db, out in table_sens
        ],
        "kept_fp32": {c.name: c.kept_fp32 for c in candidates if c.kept_fp32},
    }
    if "batching" in chosen:
        extra["batching"] = {
            name: measure.batch_curve(
                _session_run(by_name[name]), feeds[name], rounds=max(3, config.rounds // 10)
            )
            for name in dict.fromkeys(["original", best_name])
        }
    if "layout" in chosen:
        extra["layout"] = layouts(by_name[best_name], feeds[best_name])
    if config.write_versions:
        extra["versions"] = write_versions(config.model_dir, candidates, table)
    extra["files"] = {k: str(p) for k, p in report.write(table, extra, config.report_dir).items()}
    return {"variants": table, **extra}


def _session_run(c: Candidate):
    session, name = c.detector.session, c.detector.input
    return lambda x: session.run(None, {name: x})


def _measured(c: Candidate, accuracy: dict) -> measure.Variant:
    size = c.path.stat().st_size
    resolution = c.detector.preprocess.size[0]
    v = measure.Variant(c.name, c.techniques, _session_run(c), resolution, size, 0.0, str(c.path))
    v.metrics.update(accuracy)
    return v


def layouts(c: Candidate, x: np.ndarray, requests: int = 200) -> list[dict]:
    """Threads per instance against instances, wall time on this machine: a lone
    request's p50 latency, and requests per second with one client per instance."""
    out = []
    for instances, threads in ((1, 1), (1, 2), (2, 1)):
        sessions = [graph.open_session(c.path, threads, c.level) for _ in range(instances)]
        name = c.detector.input
        for s in sessions:
            s.run(None, {name: x[:1]})
        lone = []
        for i in range(50):
            start = time.perf_counter()
            sessions[0].run(None, {name: x[i % len(x)][None]})
            lone.append(time.perf_counter() - start)

        def worker(session, count, name=name):
            for i in range(count):
                session.run(None, {name: x[i % len(x)][None]})

        workers = [
            threading.Thread(target=worker, args=(s, requests // instances)) for s in sessions
        ]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
        out.append(
            {
                "instances": instances,
                "threads": threads,
                "lone_p50_ms": float(np.median(lone) * 1000),
                "requests_per_s": requests / seconds,
            }
        )
    return out


def write_versions(model_dir: Path, candidates: list[Candidate], table) -> dict[str, int]:
    """Each variant but the original as the next free version: its graph and a
    variant.json with the input size and optimisation level the backend applies."""
    rows = {r["name"]: r for r in table}
    taken = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    number, written = max(taken, default=1), {}
    for c in candidates:
        if c.name == "original":
            continue
        number += 1
        folder = model_dir / str(number)
        folder.mkdir()
        shutil.copyfile(c.path, folder / "model.onnx")
        summary = {k: rows[c.name][k] for k in ("name", "techniques", "map", "map50")}
        summary["preprocess"] = {"size": list(c.detector.preprocess.size)}
        summary["session"] = {"graph_optimization_level": c.level}
        summary["kept_fp32"] = c.kept_fp32
        (folder / "variant.json").write_text(json.dumps(summary, indent=2) + "\n")
        written[c.name] = number
    return written
