"""LoRA adapters (bitserve/llm/lora.py) against transformers + peft.

Each adapter is made by `peft` on the test's random base model (`init_lora_weights=False`:
A and B both random, so every delta bites) and saved in PEFT's format; the reference is
the same folder loaded back with `PeftModel.from_pretrained`, greedy `generate` in fp32
and its log-softmax for the logprobs.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from bitserve import kernels
from bitserve.llm import SamplingParams
from bitserve.llm.lora import PATHS, AdapterError
from bitserve.llm.models import llama
from bitserve.llm.sampling_params import SamplingError
from tests.llm.conftest import build_model, make_engine
from tests.llm.test_architectures import ARCHS, mistral_window

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
TARGETS = {  # what an adapter of each architecture targets (PEFT's module names)
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "mixtral": ATTENTION,  # not the experts: refused (test below)
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused in the checkpoint
    "qwen3_moe": ATTENTION,  # peft makes MLP targets the experts' parameters: refused
}
PROMPTS = [[1, 5, 9, 33, 70, 100, 7], [1, 44, 12], [1, *range(40, 80)], [1, 300, 200, 100, 9]]
NEW = 8


@pytest.fixture(scope="module")
def bases(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bases")
    archs = ARCHS | {"mistral": mistral_window}  # (Mistral: with its sliding window)
    return model_dirs | {name: build_model(root / name, make()) for name, make in archs.items()}


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def make_adapter(base, folder, name, seed, rank=8, targets=None):
    """A random PEFT adapter for `base` saved in `folder`, as `peft` writes it."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets or TARGETS.get(name, DENSE),
        init_lora_weights=False,
    )
    get_peft_model(hf_model(base), config).save_pretrained(folder)
    return folder


def reference(base, adapter, prompt, new=NEW):
    """transformers + peft: the greedy tokens and their log-probabilities."""
    model = hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
        logits = model(out).logits[0, len(prompt) - 1 : -1].float()
    tokens = out[0, len(prompt) :]
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def greedy(lora=None, new=NEW, logprobs=None):
    return SamplingParams(
        max_tokens=new, temperature=0, ignore_eos=True, lora=lora, logprobs=logprobs
    )


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral", "gpt2", *ARCHS, "mistral"])
def test_an_adapter_gives_transformers_peft_tokens_and_logprobs(bases, tmp_path, name):
    adapter = make_adapter(bases[name], tmp_path / "a", name, seed=1)
    engine = make_engine(
        bases[name], num_kv_blocks=64, max_loras=1, lora_modules={"a": str(adapter)}
    )
    prompt = PROMPTS[2]  # 41 tokens: past the sliding windows (24) of Mistral and Gemma
    [out] = engine_outputs(engine, [prompt], [greedy("a", logprobs=0)])
    want_tokens, want_logprobs = reference(bases[name], adapter, prompt)
    assert out.token_ids == want_tokens
    got = [step[token] for step, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(want_logprobs, abs=1e-4)


def engine_outputs(engine, prompts, params):
    from bitserve.llm.engine import LLM

    llm = LLM.__new__(LLM)
    llm.engine = engine
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama_adapters(bases, tmp_path_factory):
    """Three adapters of different ranks (a smaller rank is zero-padded in its slot), and
    one that targets only q and v (the other parts of the fused linears stay zero)."""
    root = tmp_path_factory.mktemp("llama_adapters")
    base = bases["llama"]
    made = {
        "a": make_adapter(base, root / "a", "llama", seed=1, rank=4),
        "b": make_adapter(base, root / "b", "llama", seed=2, rank=8),
        "c": make_adapter(base, root / "c", "llama", seed=3, rank=16, targets=["q_proj", "v_proj"]),
    }
    return {name: str(path) for name, path in made.items()}


@pytest.mark.parametrize("path", PATHS)
def test_one_step_mixing_three_adapters_and_the_base_gives_each_row_its_own_model(
    bases, llama_adapters, path, monkeypatch
):
    base = bases["llama"]
    engine = make_engine(base, num_kv_blocks=64, max_loras=3, lora_modules=llama_adapters)
    if path == "c" and engine.lora.kernels is None:
        pytest.skip("no C compiler here: the C kernels are not built")
    engine.lora.use_path(path)
    fused = []  # the C path's steps run the fused C layer, deltas inside, in chunks of 5
    if path == "c":
        monkeypatch.setattr(llama, "FUSED_CHUNK", 5)
        layer = engine.runner.kernels.decode_layer
        spy = lambda params, x, *rest: fused.append(len(x)) or layer(params, x, *rest)  # noqa: E731
        monkeypatch.setattr(engine.runner.kernels, "decode_layer", spy)
    steps = []
    engine.fault_hook = lambda seqs: steps.append({s.lora_id for s in seqs})
    loras = ["a", "b", "c", None] * 2  # interleaved: each adapter's rows are not contiguous
    prompts = [PROMPTS[i % 4] for i in range(8)]
    outs = engine_outputs(engine, prompts, [greedy(lora) for lora in loras])
    assert len(steps[0]) == 4  # the three adapters' rows and the base's in one step
    assert (max(fused, default=0) == 5) == (path == "c")
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        adapter = llama_adapters[lora] if lora else None
        assert out.token_ids == reference(base, adapter, prompt)[0], lora


def test_adapters_beyond_max_loras_are_evicted_and_reloaded_transparently(bases, llama_adapters):
    base = bases["llama"]
    engine = make_engine(base, num_kv_blocks=64, max_loras=2, lora_modules=llama_adapters)
    prompt = PROMPTS[1]
    for lora in ["a", "b", "c", "a"]:  # c evicts a (least recently used), a evicts b
        [out] = engine_outputs(engine, [prompt], [greedy(lora)])
        assert out.token_ids == reference(base, llama_adapters[lora], prompt)[0]
    assert engine.lora.evictions == 2 and engine.lora.loads == 4
    # all three at once with two slots: the third waits for a slot, then runs
    outs = engine_outputs(engine, [prompt] * 3, [greedy(lora) for lora in "abc"])
    for lora, out in zip("abc", outs, strict=True):
        assert out.token_ids == reference(base, llama_adapters[lora], prompt)[0]


def test_the_prefix_cache_is_keyed_by_adapter(bases, llama_adapters):
    base = bases["llama"]
    engine = make_engine(base, num_kv_blocks=64, max_loras=2, lora_modules=llama_adapters)
    bm, prompt = engine.block_manager, PROMPTS[2]  # 41 tokens: two full blocks
    engine_outputs(engine, [prompt], [greedy("a")])
    [out] = engine_outputs(engine, [prompt], [greedy()])  # the base: a's blocks not reused
    assert bm.prefix_cache_hits == 0
    assert out.token_ids == reference(base, None, prompt)[0]
    [out] = engine_outputs(engine, [prompt], [greedy("a")])  # a again: its own blocks
    assert bm.prefix_cache_hits == 32
    assert out.token_ids == reference(base, llama_adapters["a"], prompt)[0]


def test_an_unloaded_adapter_is_refused_and_a_new_one_of_its_name_is_not_served_stale(
    bases, llama_adapters
):
    base = bases["llama"]
    engine = make_engine(base, num_kv_blocks=64, max_loras=2)
    engine.lora.register("x", llama_adapters["a"])
    prompt = PROMPTS[2]
    engine_outputs(engine, [prompt], [greedy("x")])
    engine.lora.unregister("x")
    with pytest.raises(SamplingError, match="lora: adapter 'x' is not loaded"):
        engine.add_request(None, prompt, greedy("x"))
    [out] = engine_outputs(engine, [prompt], [greedy()])
    assert out.token_ids == reference(base, None, prompt)[0]
    engine.lora.register("x", llama_adapters["b"])  # the same name, other weights
    [out] = engine_outputs(engine, [prompt], [greedy("x")])
    assert out.token_ids == reference(base, llama_adapters["b"], prompt)[0]


def test_adapters_the_engine_cannot_serve_are_refused_naming_why(bases, tmp_path):
    engine = make_engine(bases["llama"], num_kv_blocks=16, max_loras=1, max_lora_rank=8)
    big = make_adapter(bases["llama"], tmp_path / "big", "llama", seed=1, rank=16)
    with pytest.raises(AdapterError, match="rank 16 is past max_lora_rank 8"):
        engine.lora.register("big", big)
    head = make_adapter(bases["llama"], tmp_path / "head", "llama", seed=1, targets=["lm_head"])
    with pytest.raises(AdapterError, match=r"lm_head.* is not a LoRA A or B weight"):
        engine.lora.register("head", head)
    moe = make_engine(bases["qwen3_moe"], num_kv_blocks=16, max_loras=1)
    experts = make_adapter(bases["qwen3_moe"], tmp_path / "moe", "moe", seed=1, targets=DENSE)
    with pytest.raises(AdapterError, match=r"experts.* is not supported"):
        moe.lora.register("experts", experts)
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        engine.lora.register("none", tmp_path)
    plain = make_engine(bases["llama"], num_kv_blocks=16)
    with pytest.raises(SamplingError, match="max_loras is 0"):
        plain.add_request(None, PROMPTS[0], greedy("big"))


@pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")
@pytest.mark.parametrize(("k", "n"), [(64, 192), (72, 37)])  # 72: not a multiple of 32
def test_the_c_kernel_adds_each_rows_own_slot_as_torch_does(k, n):
    g = torch.Generator().manual_seed(0)
    slots_, width, rows = 3, 24, 9
    a = torch.randn(slots_, width, k, generator=g)
    bt = torch.randn(slots_, width, n, generator=g)
    a[1, 16:] = 0  # a smaller rank, zero-padded: its columns are skipped
    x = torch.randn(rows, k + 8, generator=g)[:, :k]  # a row stride that is not k
    slots = torch.tensor([0, 2, -1, 1, 0, 2, -1, 1, 1], dtype=torch.int32)
    y = torch.randn(rows, n, generator=g)
    want = y.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[row] += (a[slot] @ x[row]) @ bt[slot]
    kernels.get().lora_add(x, slots, a, bt, y)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


def test_on_a_gpu_the_dense_path_is_captured_by_the_decode_graphs(
    bases, llama_adapters, monkeypatch
):
    """A pretend GPU (tests/fakedevice.py) with the graph stand-in of test_step_ops: the
    deltas are in what a CUDA graph captures (the mask a static buffer the step writes),
    and replayed decode steps mixing adapters give each row its own model's tokens."""
    from bitserve.llm import model_runner
    from tests.fakedevice import FakeCuda
    from tests.llm.test_step_ops import CallGraph

    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(model_runner, "graph_factory", lambda config: CallGraph)
    base, loras = bases["llama"], ["a", "b", None, "c"]
    with FakeCuda():
        engine = make_engine(
            base, device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
            max_loras=3, lora_modules=llama_adapters,
        )  # fmt: skip
        assert engine.lora.path == "dense" and engine.runner.graphs
        CallGraph.replays = 0
        outs = engine_outputs(engine, PROMPTS, [greedy(lora) for lora in loras])
    assert CallGraph.replays > 0
    for prompt, lora, out in zip(PROMPTS, loras, outs, strict=True):
        adapter = llama_adapters[lora] if lora else None
        assert out.token_ids == reference(base, adapter, prompt)[0], lora


def test_unloading_an_adapter_in_use_fails_its_requests_only(bases, llama_adapters):
    base = bases["llama"]
    engine = make_engine(base, num_kv_blocks=64, max_loras=2)
    engine.lora.register("x", llama_adapters["a"])
    prompt = PROMPTS[1]
    engine.add_request("with-x", prompt, greedy("x"))
    engine.add_request("base", prompt, greedy())
    engine.step()
    engine.lora.unregister("x")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert "unloaded" in finals["with-x"].error
    assert finals["base"].error is None
    assert finals["base"].outputs[0].token_ids == reference(base, None, prompt)[0]
