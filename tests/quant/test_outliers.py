"""Outlier channels: plain int8 breaks on them, int8-outlier does not.

tinylm is given outlier activation channels the way trained LLMs grow them: in every
layer a few RMSNorm weight channels are multiplied by a large factor and the matching
input columns of the next linear layers (q/k/v, gate/up) divided by it, so the
full-precision model computes the same function (checked) while those channels carry
activations far above the rest.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from bitserve.quantize.calibrate import calibrate_folder, report
from bitserve.quantize.evaluate import evaluate_llm
from bitserve.quantize.folders import Source
from tests.quant.conftest import EVAL_TOKENS, HELDOUT, TINYLM

CHANNELS = [5, 77, 200]
FACTOR = 100.0  # outliers ~60-100x the other channels' magnitude, as in LLM.int8()
FOLLOWERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outliers") / "tinylm-outliers"
    shutil.copytree(TINYLM / "1", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        for norm, linears in FOLLOWERS.items():
            tensors[f"model.layers.{i}.{norm}.weight"][CHANNELS] *= FACTOR
            for name in linears:
                tensors[f"model.layers.{i}.{name}.weight"][:, CHANNELS] /= FACTOR
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def text() -> str:
    return HELDOUT.read_text()


def quantize(source, out, method, text=None):
    from bitserve.quantize.command import _quantize_llm

    calibration = None
    if text is not None:
        calibration = out.parent / "calibration.txt"
        # calibrate on the end of the held-out text, evaluate on its start
        calibration.write_text(text[len(text) // 2 :])
    _quantize_llm(Source(source, "llm"), out, method, 32, 6.0, calibration, 2048, None)
    return out


def test_int8_outlier_keeps_what_plain_int8_loses(outlier_model, text, tmp_path) -> None:
    _, profiles = calibrate_folder(outlier_model, text[len(text) // 2 :], max_tokens=1024)
    print(report(profiles, 6.0))
    qkv = profiles["layers.3.self_attn.qkv_proj"]
    assert set(CHANNELS) <= set(qkv.outliers(6.0).tolist())
    assert float(qkv.absmax[CHANNELS].min()) > 20 * float(qkv.absmax[[0, 1, 2]].max())

    plain = quantize(outlier_model, tmp_path / "int8", "int8")
    mixed = quantize(outlier_model, tmp_path / "int8-outlier", "int8-outlier", text)
    config = json.loads((mixed / "config.json").read_text())["quantization_config"]
    assert config["method"] == "int8-outlier" and config["threshold"] == 6.0

    reference = evaluate_llm(TINYLM / "1", None, text, 256, EVAL_TOKENS, new_tokens=4)
    same = evaluate_llm(outlier_model, TINYLM / "1", text, 256, EVAL_TOKENS, new_tokens=4)
    assert abs(same["comparison"]["perplexity_change"]) < 1e-4  # the fp function is unchanged
    bad = evaluate_llm(plain, outlier_model, text, 256, EVAL_TOKENS, new_tokens=4)
    good = evaluate_llm(mixed, outlier_model, text, 256, EVAL_TOKENS, new_tokens=4)
    print("plain int8", bad["comparison"], "\nint8-outlier", good["comparison"])
    assert bad["comparison"]["perplexity_change"] > 0.05  # loses badly (~+10% here)
    assert bad["comparison"]["next_token_agreement"] < 0.9
    assert abs(good["comparison"]["perplexity_change"]) < 0.01
    assert reference["model"]["perplexity"] == pytest.approx(same["model"]["perplexity"], 1e-4)
