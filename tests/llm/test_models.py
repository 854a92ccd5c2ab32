"""Model loading: architectures, rope scaling, dtypes, the expert counter, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from bitserve.llm import LLM, SamplingParams
from bitserve.llm.models import UnsupportedArchitecture
from tests.llm.conftest import COMMON, build_model, make_engine
from tests.llm.test_engine import GREEDY, MIXED, NEW_TOKENS, generate


def hf_greedy(folder, prompt):
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_matches_transformers(tmp_path, kind):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling=ROPE[kind],
        **COMMON,
    )
    folder = build_model(tmp_path / kind, config)
    engine = make_engine(folder, num_kv_blocks=64)
    prompts = MIXED[2:4]
    assert generate(engine, prompts) == [hf_greedy(folder, p) for p in prompts]


def test_mistral_loads_and_matches(tmp_path):
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        **COMMON,
    )
    folder = build_model(tmp_path / "mistral", config)
    engine = make_engine(folder, num_kv_blocks=64)
    assert generate(engine, MIXED[:2]) == [hf_greedy(folder, p) for p in MIXED[:2]]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_runs_and_mostly_agrees(llama_dir, dtype):
    engine = make_engine(llama_dir, num_kv_blocks=64, dtype=dtype)
    # (on the CPU bf16 is the linear weights only, activations fp32: tests/llm/test_bf16.py)
    assert engine.runner.model.layers[0].mlp.down_proj.weight.dtype != torch.float32
    outputs = generate(engine, MIXED[:2])
    fp32 = generate(make_engine(llama_dir, num_kv_blocks=64), MIXED[:2])
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert outputs[0][:4] == fp32[0][:4]


def test_unsupported_architecture_is_refused_by_name(tmp_path, llama_dir):
    folder = tmp_path / "odd"
    folder.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match="FalconForCausalLM"):
        LLM(folder)


def test_pickled_checkpoints_are_refused(tmp_path, llama_dir):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((llama_dir / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(folder)


def test_tokens_per_expert_counts_every_routed_token(model_dirs):
    engine = make_engine(model_dirs["mixtral"], num_kv_blocks=64)
    prompt = MIXED[1]
    generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    counts = engine.metrics().tokens_per_expert
    tokens = len(prompt) + 3  # the last sampled token is never fed back
    assert sum(counts) == tokens * 2 * 2  # top-2, 2 layers
    assert GREEDY.max_tokens == NEW_TOKENS
