"""Quantized tinylm keeps its perplexity: int8 within 1%, int4 (group 32) within 5%.

The full-precision reference is transformers' own LlamaForCausalLM on the same windows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from bitserve.quantize.evaluate import evaluate_llm
from tests.quant.conftest import EVAL_TOKENS, HELDOUT, TINYLM


def transformers_perplexity(ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINYLM / "1", dtype=torch.float32).eval()
    window = torch.tensor(ids[:EVAL_TOKENS]).view(-1, 256)
    with torch.inference_mode():
        logits = model(window).logits[:, :-1]
    return math.exp(
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
    )


@pytest.fixture(scope="module")
def results(quantized_tinylm) -> dict:
    text = HELDOUT.read_text()
    return {
        method: evaluate_llm(folder / "1", TINYLM / "1", text, 256, EVAL_TOKENS, new_tokens=32)
        for method, folder in quantized_tinylm.items()
    }


def test_reference_perplexity_is_transformers(results, heldout_ids) -> None:
    want = transformers_perplexity(heldout_ids)
    for result in results.values():
        assert result["reference"]["perplexity"] == pytest.approx(want, rel=1e-4)
        assert result["reference"]["scored_tokens"] == EVAL_TOKENS - EVAL_TOKENS // 256


@pytest.mark.parametrize(("method", "limit"), [("int8", 0.01), ("int4", 0.05)])
def test_perplexity_stays_close(results, method, limit) -> None:
    comparison = results[method]["comparison"]
    print(method, json.dumps(comparison))  # greedy agreement, reported
    assert abs(comparison["perplexity_change"]) < limit
    assert comparison["next_token_agreement"] > (0.95 if method == "int8" else 0.85)
    assert 0 < comparison["greedy_agreement"] <= 1 and comparison["greedy_tokens"] == 8 * 32


def test_weights_shrink(results) -> None:
    assert results["int8"]["comparison"]["memory_ratio"] < 0.27
    # int4 layers, plus an int8 embedding and an int4 copy of the tied head
    assert results["int4"]["comparison"]["memory_ratio"] < 0.25


def test_config_records_the_method(quantized_tinylm) -> None:
    config = json.loads((quantized_tinylm["int4"] / "1" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "bitserve",
        "method": "int4",
        "embedding": "int8",
        "group_size": 32,
        "tied_lm_head": False,
    }
    assert (quantized_tinylm["int4"] / "config.toml").read_text() == (
        TINYLM / "config.toml"
    ).read_text()
    assert not list((quantized_tinylm["int4"] / "1").glob("*.bin"))
