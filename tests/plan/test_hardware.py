"""Right-sizing: the catalogue, the roofline arithmetic, the pick and its calibration."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bitserve.cli import main
from bitserve.plan import calibration, catalogue, hardware, shape

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 8192}  # fmt: skip
SMALL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1376,
         "vocab_size": 4096, "max_position_embeddings": 2048}  # fmt: skip
FIGURES = {"memory_gib": "memory", "bandwidth_gbs": "bandwidth", "fp32_tflops": "fp32_tflops",
           "bf16_tflops": "bf16_tflops", "price_per_hour": "price_per_hour"}  # fmt: skip


def test_every_catalogue_figure_has_a_source_and_a_date():
    shapes = catalogue.load()
    assert {s.kind for s in shapes} == {"cpu", "gpu"}
    for s in shapes:
        assert s.sources, s.name
        if "all" in s.sources:
            continue
        for figure, key in FIGURES.items():
            if getattr(s, figure) is not None:
                source = s.sources[key]
                assert any(str(y) in source for y in range(2017, 2030)), (s.name, figure)


def test_decode_is_weights_over_bandwidth_at_batch_one():
    model = shape.from_config(LLAMA_8B)
    h100 = next(s for s in catalogue.load() if s.name.startswith("1x H100"))
    eff = hardware.Efficiency(bandwidth=1.0, flops=1.0)
    weights = 16e9
    step = hardware.step_time(model, h100, eff, 1, 0, weights)
    assert step == pytest.approx(weights / 3.35e12)
    # batching 32 sequences costs far less than 32 steps: the weight read is shared
    assert hardware.step_time(model, h100, eff, 32, 0, weights) < 1.5 * step


def test_small_model_at_low_rate_goes_to_a_cpu_big_one_to_a_gpu():
    cheap = hardware.Workload(rate=0.2, input_len=128, output_len=64, ttft_s=1.0, tpot_s=0.1)
    plans = hardware.plan_all(shape.from_config(SMALL), catalogue.load(), cheap)
    assert hardware.recommend(plans).shape.kind == "cpu"
    busy = hardware.Workload(rate=5, ttft_s=0.5, tpot_s=0.05)
    plans = hardware.plan_all(shape.from_config(LLAMA_8B), catalogue.load(), busy)
    best = hardware.recommend(plans)
    assert best.shape.kind == "gpu" and best.meets_slo
    priced = [p for p in plans if p.meets_slo and p.cost_per_hour is not None]
    assert best.cost_per_hour == min(p.cost_per_hour for p in priced)
    assert not any(p.fits for p in plans if p.shape.memory < 15e9)


def test_bench_result_calibrates_cpu_shapes(tmp_path):
    model = shape.from_config(SMALL)
    here = next(s for s in catalogue.load() if s.measured)
    ideal = hardware.Efficiency(1.0, 1.0)
    weights = hardware.memory.weight_bytes(model, "float32", None)
    step = hardware.step_time(model, here, ideal, 1, 128 + 32, weights)
    point = {"load": "rate=1", "completed": 10, "request_throughput": 1.0,
             "total_input_tokens": 1280, "total_output_tokens": 640,
             "tpot": {"median_ms": 2 * step * 1e3}, "ttft": {"median_ms": 50.0}}  # fmt: skip
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"config": {}, "points": [point]}))
    eff, note = calibration.calibrate(path, model, here)
    assert eff.bandwidth == pytest.approx(0.5)
    assert "bandwidth efficiency 0.50" in note


def test_cli_prints_every_shape_and_the_reasoning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    args = ["plan", "hardware", str(tmp_path), "--rate", "2", "--slo", "ttft:500,tpot:50"]
    answer = CliRunner().invoke(main, args, catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    for s in catalogue.load():
        assert s.name in answer.output
    assert "recommended:" in answer.output and "because:" in answer.output
    assert "does not fit in memory" in answer.output
