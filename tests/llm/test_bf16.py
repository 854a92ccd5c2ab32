"""bf16 weights on the CPU (`dtype = "bfloat16"`, csrc/bf16.c) against torch and
transformers, through both inner loops: vdpbf16ps (x rounded to bf16) and widen + FMA
(x exact, what a CPU without avx512_bf16 runs; forced here with `bf16_mode(0)`).

The reference is transformers' model with every linear weight rounded to bf16 and run in
fp32: the same weights, so the widen loop differs only by summation order (the fp32
parity tolerance, 1e-4 on log-probabilities; measured <= 7e-6). vdpbf16ps also rounds
each linear's input to bf16 (up to 2^-9 relative an element): against the plain
reference that moved these log-probabilities by up to 4.3e-2, so its reference rounds
the inputs too (a pre-hook) and the tolerance is 1e-2 (measured <= 5e-3 on Qwen2, 2e-4
on Llama: what is left is summation order, and an x within fp32 noise of a rounding
boundary that rounds the other way, a bf16 ulp that these large random weights carry
far). The kernel alone is held to torch on the same rounded x.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from bitserve import kernels
from bitserve.llm import LLM, SamplingParams
from bitserve.llm.models.layers import Linear
from tests.llm.conftest import make_engine
from tests.llm.test_engine import MIXED

needs_kernels = pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")
MODES = {"widen": 0, "dpbf16": 1}
LOGPROB_TOL = {"widen": 1e-4, "dpbf16": 1e-2}
STEPS = 16


def has_avx512_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        return any("avx512_bf16" in line.split() for line in f if line.startswith("flags"))


@pytest.fixture
def mode(request):
    """Run the test under one inner loop, then put the default back."""
    k = kernels.get()
    default = k.bf16_mode()
    if k.bf16_mode(MODES[request.param]) != MODES[request.param]:
        k.bf16_mode(default)
        pytest.skip("this build has no avx512_bf16")
    yield request.param
    k.bf16_mode(default)


@needs_kernels
def test_dpbf16_is_built_where_the_cpu_has_avx512_bf16():
    assert kernels.get().bf16_mode() == int(has_avx512_bf16())


@needs_kernels
def test_bitserve_bf16_dot_0_forces_the_widen_loop(monkeypatch):
    """The switch a CPU without avx512_bf16 takes anyway, for anyone to take."""
    monkeypatch.setenv("BITSERVE_BF16_DOT", "0")
    kernels.reset()
    try:
        assert kernels.get().bf16_mode() == 0
    finally:
        monkeypatch.delenv("BITSERVE_BF16_DOT")
        kernels.reset()
    assert kernels.get().bf16_mode() == int(has_avx512_bf16())


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(64, 128), (33, 67), (100, 31), (16, 2)])
def test_kernel_matches_torch(mode, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k + 5, generator=g)[:, :k]  # a row stride that is not k
    lib = kernels.get()
    panels = lib.pack_bf16(w)  # kept alive: the view holds a raw pointer to it
    got = lib.gemv(kernels.bf16_weight(panels, n, k, b), x)
    xs = x.to(torch.bfloat16) if mode == "dpbf16" else x  # what each loop multiplies
    want = xs.double() @ w.double().t() + b.double()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-5 * k**0.5)


@needs_kernels
def test_a_build_without_avx512_bf16_runs_the_widen_loop(tmp_path, monkeypatch):
    """What an AVX-512 CPU without bf16 (Ice Lake) builds: `-mno-avx512bf16` here."""
    monkeypatch.setenv("BITSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "COMPILE_FLAGS", [*kernels.COMPILE_FLAGS, "-mno-avx512bf16"])
    lib = kernels.Kernels(kernels.build(kernels.compiler()))
    assert lib.bf16_mode(1) == 0  # vdpbf16ps asked for, not built: widen it is
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 66, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 66, generator=g)
    panels = lib.pack_bf16(w)
    got = lib.gemv(kernels.bf16_weight(panels, 40, 66, None), x)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-4)


def bf16_reference(folder, mode="widen"):
    """transformers' model with its linear weights rounded to bf16, run in fp32 (a tied
    LM head stays fp32, as bitserve keeps it); under dpbf16 those linears' inputs are
    rounded to bf16 too, as vdpbf16ps rounds them."""
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    tied = hf.lm_head.weight is hf.get_input_embeddings().weight
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and not (tied and name == "lm_head"):
            module.weight.data = module.weight.data.to(torch.bfloat16).float()
            if mode == "dpbf16":
                module.register_forward_pre_hook(lambda _, a: (a[0].bfloat16().float(),))
    return hf


def run(engine, prompt):
    llm = LLM.__new__(LLM)
    llm.engine = engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    return llm.generate([prompt], params)[0].outputs[0]


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES), indirect=True)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bf16_model_matches_transformers_on_the_same_weights(model_dirs, name, mode):
    engine = make_engine(model_dirs[name], num_kv_blocks=64, dtype="bfloat16")
    model = engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype is torch.bfloat16 and qkv.packed  # the bf16 kernel's panels
    assert model.fuse_rows > 0  # decode runs the fused C layer over kind-5 weights
    hf = bf16_reference(model_dirs[name], mode)
    prompt = MIXED[2]
    out = run(engine, prompt)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
        tokens = want[0, len(prompt) :].tolist()
        logprobs = torch.log_softmax(hf(want[:, :-1]).logits[0, len(prompt) - 1 :], -1)
    assert out.token_ids == tokens
    for step, entry in enumerate(out.logprobs):
        for token, value in entry.items():
            assert value == pytest.approx(float(logprobs[step, token]), abs=LOGPROB_TOL[mode])


@pytest.fixture
def no_kernels():
    kernels.reset(enabled=False)
    yield
    kernels.reset()


def test_bf16_without_kernels_widens_in_torch(llama_dir, no_kernels):
    """No compiler: the weights stay bf16 and torch widens them per call (exact)."""
    engine = make_engine(llama_dir, num_kv_blocks=64, dtype="bfloat16")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.weight.dtype is torch.bfloat16 and not m.packed for m in linears)
    hf = bf16_reference(llama_dir)
    prompt = MIXED[1]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
    assert run(engine, prompt).token_ids == want[0, len(prompt) :].tolist()


@needs_kernels
@pytest.mark.parametrize("mode", ["widen"], indirect=True)
def test_a_lora_adapter_on_bf16_weights_gives_peft_tokens_and_logprobs(llama_dir, tmp_path, mode):
    """LoRA's A and B stay fp32 beside bf16 weights; the reference is peft on the same
    bf16-rounded base (saved as an fp32 folder: bitserve rounds it again, a no-op)."""
    from tests.llm.test_lora import PROMPTS, engine_outputs, greedy, make_adapter, reference

    base = tmp_path / "base"
    bf16_reference(llama_dir).save_pretrained(base)
    for f in llama_dir.glob("*token*"):
        shutil.copy(f, base / f.name)
    adapter = make_adapter(base, tmp_path / "a", "llama", seed=1)
    engine = make_engine(
        base, num_kv_blocks=64, dtype="bfloat16", max_loras=1, lora_modules={"a": str(adapter)}
    )
    assert engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype is torch.bfloat16
    [out] = engine_outputs(engine, [PROMPTS[2]], [greedy("a", logprobs=0)])
    want_tokens, want_logprobs = reference(base, adapter, PROMPTS[2])
    assert out.token_ids == want_tokens
    got = [step[token] for step, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(want_logprobs, abs=LOGPROB_TOL[mode])
