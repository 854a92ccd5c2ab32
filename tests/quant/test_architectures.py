"""Every architecture the engine serves quantizes and loads: Llama (GQA), Qwen2 (qkv bias,
tied head), Mixtral (experts quantized too: test_moe.py) and GPT-2, as tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from bitserve.llm import LLM, SamplingParams
from bitserve.llm.config import EngineConfig
from bitserve.llm.models import load_model
from bitserve.quantize.command import _quantize_llm
from bitserve.quantize.folders import Source
from bitserve.quantize.scoring import window_logits
from tests.llm.conftest import CONFIGS, VOCAB, build_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: build_model(root / name, make()) for name, make in CONFIGS.items()}


def logits(folder) -> torch.Tensor:
    model = load_model(EngineConfig(model=folder, device="cpu", num_kv_blocks=1))
    ids = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    return window_logits(model, ids)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
# random weights (init range 0.2) amplify quantization error, and Mixtral's top-2 routing
# flips on small changes; the quality checks are on the trained tinylm (test_tinylm.py)
@pytest.mark.parametrize(("method", "limit"), [("int8", 0.2), ("int4", 0.7)])
def test_quantize_load_generate(folders, tmp_path, arch, method, limit) -> None:
    out = tmp_path / f"{arch}-{method}"
    _quantize_llm(Source(folders[arch], "llm"), out, method, 32, 6.0, None, 0, None)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["method"] == method
    want, got = logits(folders[arch]), logits(out)
    err = float((got - want).norm() / want.norm())
    print(arch, method, f"logits relative error {err:.4f}")
    assert err < limit
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = LLM(out, num_kv_blocks=32).generate([5, 6, 7, 8], greedy)[0].outputs[0]
    assert len(text.token_ids) == 8
