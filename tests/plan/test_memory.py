"""Memory estimates from config.json against the tensors the real engine allocates."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from bitserve.cli import main
from bitserve.plan import memory, shape
from tests.llm.conftest import CONFIGS, build_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-models")
    return {name: build_model(root / name, make()) for name, make in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_formula_counts_the_checkpoint(model_dirs, name):
    folder = model_dirs[name]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert shape.from_config(shape.read_config(folder)).params() == stored


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("seqs", "context"), [(2, 100), (64, 512)])
def test_estimate_within_10_percent_of_engine(model_dirs, name, seqs, context):
    folder = model_dirs[name]
    model = shape.from_config(shape.read_config(folder))
    plan = memory.estimate(model, seqs, context)
    measured = memory.measure(folder, seqs, context)
    assert measured["num_blocks"] == plan.num_blocks
    assert measured["kv_cache"] == plan.kv_cache + plan.kv_padding
    assert plan.static == pytest.approx(measured["total"], rel=0.10)


def test_kv_bytes_per_token_is_the_textbook_formula():
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
          "vocab_size": 128256}  # fmt: skip
    model = shape.from_config(hf)
    assert model.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert 8.0e9 < model.params() < 8.1e9  # Llama 3 8B
    matrices, rest = model.layer_matrix_params(), model.other_params() - 2 * 128256 * 4096
    table = 128256 * 4096  # untied: an embedding and an LM head of this size
    # int8: a byte per weight + an fp32 scale per row; norms stay bf16
    int8 = matrices * (1 + 4 / 4096) + 2 * (table + 128256 * 4) + 2 * rest
    assert memory.weight_bytes(model, "bfloat16", "int8") == int(int8)
    # int4: half a byte + a bf16 scale and zero per group of 32; the embedding int8
    int4 = matrices * 0.625 + table + 128256 * 4 + table * 0.625 + 2 * rest
    assert memory.weight_bytes(model, "bfloat16", "int4") == int(int4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_estimate_within_10_percent_of_engine(model_dirs, name, method, tmp_path):
    """`--quant` predicts what the engine holds for the folder `bitserve quantize` writes."""
    out = tmp_path / method
    args = ["quantize", str(model_dirs[name]), str(out), "--method", method]
    answer = CliRunner().invoke(main, args, catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    model = shape.from_config(shape.read_config(model_dirs[name]))
    plan = memory.estimate(model, 8, 256, quant=method)
    measured = memory.measure(out, 8, 256)
    assert plan.static == pytest.approx(measured["total"], rel=0.10)
    assert plan.weights + plan.tables == pytest.approx(measured["other"], rel=0.10)


def test_cli_prints_parts_and_checks_against_the_engine(model_dirs):
    args = ["plan", "memory", str(model_dirs["llama"]), "--max-seqs", "8", "--context", "256"]
    answer = CliRunner().invoke(main, [*args, "--check"], catch_exceptions=False)
    assert answer.exit_code == 0, answer.output
    for word in ("weights", "KV cache", "activations", "engine built at this size", "0.0%"):
        assert word in answer.output


def test_cli_checks_a_quantized_plan_against_the_quantized_engine(model_dirs):
    args = ["plan", "memory", str(model_dirs["llama"]), "--max-seqs", "8", "--context", "256"]
    answer = CliRunner().invoke(main, [*args, "--quant", "int8", "--check"])
    assert answer.exit_code == 0, answer.output
    assert "weights (int8)" in answer.output and "engine built at this size" in answer.output
