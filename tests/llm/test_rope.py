"""RoPE scalings that take a checkpoint past its original window (llm/rope.py): the
context they allow, derived as vLLM derives it, and token-exact parity with
transformers' greedy `generate` (fp32, each prompt alone, a fresh model per prompt:
dynamic NTK keeps the frequencies of its last forward) across the switch.

The tiny models have an original window of 32 tokens; the prompts are 12 tokens
(decoding crosses 32), 20 (crosses with a few tokens) and 40 (the prompt starts past
it), in one batch, in 16-token chunks, under preemption and with shared prefixes.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from bitserve.backends.llm import LLMService
from bitserve.config import ModelConfig
from bitserve.llm import SamplingParams
from bitserve.llm.config import EngineConfig
from bitserve.llm.models import load_model
from bitserve.llm.rope import RopeRegime, derived_max_len
from bitserve.llm.scheduler import RequestTooLong
from bitserve.quantize.scoring import window_logits
from tests.conftest import Server
from tests.llm.conftest import COMMON, build_model, make_engine
from tests.llm.test_engine import generate, random_prompts

WINDOW = 32  # max_position_embeddings (dynamic) / original_max_position_embeddings
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = random_prompts([12, 20, 40], seed=3)
PREFIX = random_prompts([36], seed=4)[0]
# short then long over one prefix: a block computed short must not serve the long one
SHARED = [PREFIX[:20], [*PREFIX, 5, 6, 7, 8], PREFIX[:22], [*PREFIX, 9, 10, 11, 12]]
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    **COMMON,
)


def llama(rope: dict, max_positions: int = 128) -> LlamaConfig:
    return LlamaConfig(rope_parameters=rope, **dict(SMALL, max_position_embeddings=max_positions))


def phi3() -> Phi3Config:
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.5 * i for i in range(8)],
    )
    small = dict(SMALL, max_position_embeddings=128)
    return Phi3Config(original_max_position_embeddings=WINDOW, rope_parameters=rope, **small)


CONFIGS = {
    "dynamic2": lambda: llama({"rope_type": "dynamic", "factor": 2.0}, WINDOW),
    "dynamic4": lambda: llama({"rope_type": "dynamic", "factor": 4.0}, WINDOW),
    "longrope": phi3,
    # a Llama keeps its short-factor keys past the switch (only the Phi models recompute)
    "llama_longrope": lambda: llama(
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": WINDOW,
        }
    ),
    "yarn": lambda: llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}
    ),
    "llama3": lambda: llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": WINDOW,
        }
    ),
}
SWITCHING = ["dynamic2", "dynamic4", "longrope", "llama_longrope"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {name: build_model(root / name, make()) for name, make in CONFIGS.items()}


_references: dict[tuple, list[int]] = {}


def reference(folder, prompt, new=NEW) -> list[int]:
    key = (str(folder), tuple(prompt), new)
    if key not in _references:
        hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        _references[key] = out[0, len(prompt) :].tolist()
    return _references[key]


def assert_parity(folder, prompts, outputs, new=NEW):
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == reference(folder, prompt, new), f"{len(prompt)}-token prompt"


# -- the context a checkpoint allows ----------------------------------------------------


@pytest.mark.parametrize(
    ("rope", "want"),
    [
        (None, 4096),
        ({"rope_type": "linear", "factor": 2.0}, 8192),
        ({"type": "dynamic", "factor": 4.0}, 16384),  # the old key name
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}, 4096),
        ({"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, 4096),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, 4096),
    ],
)
def test_max_model_len_is_derived_from_the_rope_scaling_as_vllm_does(rope, want):
    hf = {"max_position_embeddings": 4096, "rope_scaling": rope}
    assert derived_max_len(hf) == want


def test_gemma3s_factor_is_not_a_longer_context():
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0}}
    assert derived_max_len({"model_type": "gemma3_text", "max_position_embeddings": 512}) == 512
    hf = {"model_type": "gemma3_text", "max_position_embeddings": 512, "rope_parameters": rope}
    assert derived_max_len(hf) == 512


def test_a_request_within_the_derived_length_is_served_and_one_past_it_refused(dirs):
    engine = make_engine(dirs["dynamic2"], num_kv_blocks=16)
    assert engine.config.max_model_len == 2 * WINDOW  # dynamic, factor 2
    prompt = PROMPTS[2]  # 40 tokens + 24 = 64: the whole derived length
    assert generate(engine, [prompt], GREEDY) == [reference(dirs["dynamic2"], prompt)]
    with pytest.raises(RequestTooLong, match="maximum context length is 64 tokens"):
        engine.add_request("long", prompt, SamplingParams(max_tokens=NEW + 1))
    capped = make_engine(dirs["dynamic2"], num_kv_blocks=16, max_model_len=48)
    assert capped.config.max_model_len == 48


# -- parity across the switch -------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_mixed_batch_across_the_original_window_matches_transformers(dirs, name):
    engine = make_engine(dirs[name], num_kv_blocks=64)
    assert_parity(dirs[name], PROMPTS, generate(engine, PROMPTS, GREEDY))


@pytest.mark.parametrize("name", SWITCHING)
def test_chunked_prefill_and_preemption_across_the_switch_match_transformers(dirs, name):
    """16-token chunks: the 40-token prompt's first chunks lie inside the window, and a
    longrope re-prefill at the switch runs in chunks too; a tight pool preempts."""
    engine = make_engine(dirs[name], num_kv_blocks=8, max_num_batched_tokens=16)
    assert_parity(dirs[name], PROMPTS, generate(engine, PROMPTS, GREEDY))
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", SWITCHING)
def test_prefix_caching_never_reuses_keys_rotated_for_another_length(dirs, name):
    """A 20-token prompt's first block (rotated inside the window: 8 new tokens keep it
    there) is not reused by the 40-token prompt over the same tokens (rotated past
    it), but is by a 22-token one; the second 40-token prompt reuses the first's."""
    engine = make_engine(dirs[name], num_kv_blocks=64)
    bm = engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs, hits = [], []
    for prompt in SHARED:  # one after another, each finds the blocks of those before
        before = bm.prefix_cache_hits
        outputs += generate(engine, [prompt], params)
        hits.append(bm.prefix_cache_hits - before)
    assert_parity(dirs[name], SHARED, outputs, new=8)
    assert hits == [0, 0, 16, 32]


def test_longrope_recomputes_a_sequence_once_at_the_switch(dirs):
    """The 12-token prompt is computed once, then again whole (33 tokens, long factors)
    when it reaches original_max_position_embeddings + 1, as transformers does."""
    engine = make_engine(dirs["longrope"], num_kv_blocks=64)
    engine.add_request("a", PROMPTS[0], GREEDY)
    computed = []
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        computed += [n for _, n in batch.scheduled]
        for out in engine.run(batch):
            tokens = out.outputs[0].token_ids
    assert computed == [12] + [1] * (WINDOW - 12) + [WINDOW + 1] + [1] * (NEW - WINDOW + 12 - 2)
    assert tokens == reference(dirs["longrope"], PROMPTS[0])


def test_the_regime_of_a_length():
    regime = RopeRegime(phi3().to_dict())
    assert regime.switch == WINDOW
    assert regime.switches(20, WINDOW + 1) and not regime.switches(WINDOW + 1, WINDOW + 2)
    assert regime.block_key(20, 16) != regime.block_key(40, 16)
    assert RopeRegime(llama({"rope_type": "yarn", "factor": 4.0}).to_dict()).static


def test_the_llm_service_admits_the_derived_length_and_refuses_past_it_naming_it(dirs):
    """The backend's front door (a 400 on the server: RequestTooLong) with no
    max_model_len in the model's parameters: the derived 64 is what it allows."""
    config = ModelConfig.model_validate(
        {"name": "ntk", "backend": "llm", "parameters": {"num_kv_blocks": 16}}
    )
    svc = LLMService(config, dirs["dynamic2"])

    async def go():
        await svc.start()
        try:
            assert svc.max_model_len == 2 * WINDOW
            params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
            (admitted,) = svc.process([PROMPTS[2]], [params])  # 40 + 24 = 64
            outs = [out async for out in svc.generate(admitted)]
            assert outs[-1].outputs[0].token_ids == reference(dirs["dynamic2"], PROMPTS[2])
            longer = SamplingParams(temperature=0, max_tokens=NEW + 1)
            with pytest.raises(RequestTooLong, match="maximum context length is 64 tokens"):
                svc.process([PROMPTS[2]], [longer])
        finally:
            await svc.stop()

    asyncio.run(go())


@pytest.mark.slow
def test_the_server_serves_the_derived_length_and_refuses_past_it_naming_it(dirs, tmp_path):
    """A real `bitserve serve` over the dynamic checkpoint with no max_model_len: the
    derived 64 is logged, listed in /v1/models, served, and one token more is a 400."""
    repository = tmp_path / "models"
    shutil.copytree(dirs["dynamic2"], repository / "ntk" / "1")
    (repository / "ntk" / "config.toml").write_text(
        'backend = "llm"\n[parameters]\nnum_kv_blocks = 16\n'
    )
    server = Server(repository)
    try:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["max_model_len"] for m in models] == [2 * WINDOW]
        body = {"model": "ntk", "prompt": PROMPTS[2], "max_tokens": NEW, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == NEW
        r = httpx.post(server.url + "/v1/completions", json=dict(body, max_tokens=NEW + 1))
        assert r.status_code == 400
        assert "maximum context length is 64 tokens" in r.json()["error"]["message"]
    finally:
        server.stop()
    assert "max_model_len 64 (config.json and its rope scaling allow 64)" in server.log.read_text()


@pytest.mark.parametrize("name", SWITCHING)
def test_a_whole_window_scored_at_once_matches_transformers_logits(dirs, name):
    """`bitserve eval`'s scoring (one forward over a window past the switch) rotates
    every token for the window's length, as transformers' forward does."""
    model = load_model(EngineConfig(model=dirs[name], device="cpu", num_kv_blocks=1))
    got = window_logits(model, PROMPTS[2])
    hf = AutoModelForCausalLM.from_pretrained(dirs[name], attn_implementation="eager").eval()
    with torch.inference_mode():
        want = hf(torch.tensor([PROMPTS[2]])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
