"""Token-exact parity with transformers for Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and
Phi-4-mini's config form, sliding windows (Mistral, Qwen, Gemma), dynamic and longrope
RoPE, under the scheduling paths of test_engine.py.

References are transformers' greedy `generate` in fp32 with eager attention (the
arithmetic Gemma's soft-capping needs), each prompt alone. The tiny configs make every
departure bite: windows shorter than the prompts, soft caps low enough to change
scores, a head_dim unlike hidden / heads, RoPE scalings whose switch is crossed.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from bitserve import kernels
from bitserve.llm import SamplingParams
from bitserve.llm.block_manager import cdiv
from bitserve.plan import shape
from tests.llm.conftest import COMMON, build_model, make_engine
from tests.llm.test_engine import MIXED, NEW_TOKENS, SHARED, generate

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    **COMMON,
)
WINDOW = 24  # shorter than most of MIXED's prompts (3, 17, 40, 64, 100 tokens)
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(8)],
    long_factor=[2.0 + 0.5 * i for i in range(8)],
)


def qwen3():
    return Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, **SMALL)


def gemma2():
    return Gemma2Config(
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        **SMALL,
    )


def gemma3():
    return Gemma3TextConfig(
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
        **SMALL,
    )


def phi3():
    rope = dict(LONGROPE, rope_theta=10000.0, original_max_position_embeddings=256)
    return Phi3Config(num_hidden_layers=2, rope_parameters=rope, **SMALL)


def phi4_mini():
    """Phi-4-mini's form: partial rotary, tied embeddings, longrope."""
    rope = dict(LONGROPE, rope_theta=10000.0, original_max_position_embeddings=256)
    rope["short_factor"], rope["long_factor"] = rope["short_factor"][:6], rope["long_factor"][:6]
    return Phi3Config(
        num_hidden_layers=2,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        rope_parameters=dict(rope, partial_rotary_factor=0.75),
        **SMALL,
    )


def mistral_window():
    return MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SMALL)


def qwen3_window():
    """Qwen's use_sliding_window: layers from max_window_layers on slide."""
    return Qwen3Config(
        num_hidden_layers=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        **SMALL,
    )


def qwen3_moe():
    """Experts in layers 0 and 2, a dense MLP in layer 1; top-k weights not renormalised."""
    return Qwen3MoeConfig(
        num_hidden_layers=3,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        **SMALL,
    )


ARCHS = {"qwen3": qwen3, "gemma2": gemma2, "gemma3": gemma3, "phi3": phi3, "qwen3_moe": qwen3_moe}
EXTRA = {"phi4_mini": phi4_mini, "mistral_window": mistral_window, "qwen3_window": qwen3_window}


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {name: build_model(root / name, make()) for name, make in (ARCHS | EXTRA).items()}


_references: dict[tuple, list[int]] = {}
_hf: dict[str, torch.nn.Module] = {}


def reference(folder, prompt, new_tokens=NEW_TOKENS, fresh=False) -> list[int]:
    """`fresh`: a new transformers model for this prompt (dynamic RoPE keeps the grown
    frequencies of an earlier `generate` on the same object)."""
    key = (str(folder), tuple(prompt), new_tokens)
    if key not in _references:
        if str(folder) not in _hf or fresh:
            _hf[str(folder)] = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation="eager"
            ).eval()
        with torch.inference_mode():
            out = _hf[str(folder)].generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _references[key] = out[0, len(prompt) :].tolist()
    return _references[key]


def assert_parity(folder, prompts, outputs, fresh=False):
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == reference(folder, prompt, fresh=fresh)


@pytest.mark.parametrize("name", list(ARCHS) + list(EXTRA))
def test_greedy_matches_transformers_on_a_mixed_batch(arch_dirs, name):
    engine = make_engine(arch_dirs[name], num_kv_blocks=64)
    assert_parity(arch_dirs[name], MIXED, generate(engine, MIXED))


@pytest.mark.parametrize("name", [*ARCHS, "mistral_window"])
def test_parity_under_preemption_and_16_token_chunks(arch_dirs, name):
    engine = make_engine(arch_dirs[name], num_kv_blocks=12, max_num_batched_tokens=16)
    assert_parity(arch_dirs[name], MIXED, generate(engine, MIXED))
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("name", "caching"),
    [(name, True) for name in [*ARCHS, "mistral_window"]]
    + [("gemma2", False), ("mistral_window", False)],  # off: windows and soft-caps alone
)
def test_parity_with_shared_prefixes(arch_dirs, name, caching):
    engine = make_engine(arch_dirs[name], num_kv_blocks=64, enable_prefix_caching=caching)
    outputs = [generate(engine, [prompt])[0] for prompt in SHARED[:2]]  # one after another
    outputs += generate(engine, SHARED)  # and together
    assert_parity(arch_dirs[name], SHARED[:2] + SHARED, outputs)
    hits = engine.block_manager.prefix_cache_hits
    assert hits > 0 if caching else hits == 0


def test_a_long_generation_under_a_sliding_window_holds_a_bounded_number_of_blocks(arch_dirs):
    folder = arch_dirs["mistral_window"]
    engine = make_engine(folder, num_kv_blocks=16)
    bm = engine.block_manager
    assert bm.window == WINDOW
    engine.add_request(
        "long", MIXED[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    held = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        held.append(bm.num_blocks - bm.num_free_blocks)
        if engine.has_unfinished_requests():  # freed blocks count as neither held nor used
            m = engine.metrics()
            assert m.kv_slots_allocated == held[-1] * bm.block_size
            assert 0 <= m.kv_waste < 1
    # 217 tokens would take 14 blocks; the window keeps at most its span plus the block being filled
    assert max(held) <= cdiv(WINDOW, bm.block_size) + 2
    assert tokens == reference(folder, MIXED[1], 200)


def test_blocks_needed_is_what_a_windowed_sequence_ever_holds(arch_dirs):
    """What admission may ask for (Scheduler.check_fits): the long generation above
    never held more than this, with a 16-token step budget."""
    bm = make_engine(arch_dirs["mistral_window"], num_kv_blocks=8).block_manager
    assert bm.blocks_needed(217, chunk=16) == cdiv(WINDOW - 1 + 16, 16) + 1 == 4
    assert bm.blocks_needed(20, chunk=16) == 2  # shorter than the window: all its blocks
    bm.window = None
    assert bm.blocks_needed(217, chunk=16) == 14


def test_global_layers_keep_every_block(arch_dirs):
    """Gemma's global layers see the whole context: nothing is freed early."""
    assert make_engine(arch_dirs["gemma2"], num_kv_blocks=8).block_manager.window is None


def test_dynamic_rope_matches_transformers_past_max_position_embeddings(tmp_path):
    small = dict(SMALL, max_position_embeddings=64)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(num_hidden_layers=2, rope_parameters=rope, **small)
    folder = build_model(tmp_path / "dynamic", config)
    engine = make_engine(folder, num_kv_blocks=64, max_model_len=256)
    prompts = MIXED[2:4]  # 40 and 64 tokens: decoding crosses position 64, where NTK starts
    assert_parity(folder, prompts, generate(engine, prompts), fresh=True)


def test_longrope_switches_to_the_long_factors_with_the_sequence(tmp_path):
    """A sequence past original_max_position_embeddings uses the long factors (a
    40-token prompt crosses 48 while decoding and is computed again, a 64-token one
    starts past it). transformers reads the length at the config's top level."""
    rope = dict(LONGROPE, rope_theta=10000.0)
    config = Phi3Config(
        num_hidden_layers=2, original_max_position_embeddings=48, rope_parameters=rope, **SMALL
    )
    folder = build_model(tmp_path / "longrope", config)
    engine = make_engine(folder, num_kv_blocks=64)
    prompts = [MIXED[2], MIXED[3]]
    assert_parity(folder, prompts, generate(engine, prompts))


def test_qwen3_moe_counts_tokens_in_its_expert_layers_only(arch_dirs):
    engine = make_engine(arch_dirs["qwen3_moe"], num_kv_blocks=64)
    prompt = MIXED[1]
    generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    counts = engine.metrics().tokens_per_expert
    assert len(counts) == 4
    assert sum(counts) == (len(prompt) + 3) * 2 * 2  # top-2, 2 of the 3 layers have experts


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("phi3", marks=pytest.mark.slow)])
def test_tensor_parallel_2_matches_transformers(arch_dirs, name):
    """Experts cut like a dense MLP (Qwen3-MoE); Phi-3's fused checkpoint tensors cut
    per part, so each rank holds its own q, k, v heads and gate, up columns."""
    engine = make_engine(arch_dirs[name], tensor_parallel_size=2, num_kv_blocks=12)
    try:
        assert_parity(arch_dirs[name], MIXED, generate(engine, MIXED))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", list(ARCHS))
def test_plan_counts_every_checkpoint_parameter(arch_dirs, name):
    """`bitserve plan` sizes these families too (qk-norm, sandwich norms, sparse layers)."""
    folder = arch_dirs[name]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert shape.from_config(shape.read_config(folder)).params() == stored


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "phi3", "mistral_window"])
def test_small_decode_steps_take_the_fused_c_layer(arch_dirs, name):
    """qk-norm, sandwich norms, GeGLU, soft-caps, windows, longrope: all in the C layer
    (the parity tests above ran through it); Phi-4-mini's partial rotary is not."""
    if kernels.get() is None:
        pytest.skip("no C compiler: decode runs in torch")
    assert make_engine(arch_dirs[name], num_kv_blocks=8).runner.model.fuse_rows > 0
    assert make_engine(arch_dirs["phi4_mini"], num_kv_blocks=8).runner.model.fuse_rows == 0


def test_admission_counts_only_the_window(arch_dirs):
    """A generation longer than the pool is admitted when the window bounds what it holds
    (Scheduler.check_fits asks blocks_needed), and matches transformers."""
    folder = arch_dirs["mistral_window"]
    engine = make_engine(folder, num_kv_blocks=6, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    engine.add_request("long", MIXED[1], params)  # 137 tokens: 9 blocks without the window
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == reference(folder, MIXED[1], 120)
