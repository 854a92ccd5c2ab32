"""Every feature's GPU path on a pretend cuda device (tests/fakedevice.py), on this CPU.

No GPU is here, so a CPU tensor meeting a cuda one (the error CUDA raises at once) would
only show on a lent GPU. `FakeCuda` makes "cuda" tensors that compute on the CPU but
raise as CUDA does when an op mixes them with CPU tensors. Each test runs one feature
there: an LLM engine step with the torch attention path (kernels off, as on cuda),
sampling, the grammar masks, a diffusion step, and each torch-running backend's
forward; results are held to the same references as on the CPU (transformers, eager
modules, the CPU run).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve import kernels
from bitserve.llm.engine import LLMEngine
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.structured import Guide, apply_masks, mask_rows
from bitserve.tensors import coerce
from tests.fakedevice import DeviceMismatch, FakeCuda, host, on_device
from tests.llm.conftest import CONFIGS, build_model
from tests.llm.test_engine import MIXED, MODELS, assert_parity, generate


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(root / name, make()) for name, make in CONFIGS.items()}


@pytest.fixture(scope="module")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


@pytest.fixture
def no_kernels(monkeypatch):
    """The C kernels are CPU-only: on cuda every attention takes the torch path."""
    monkeypatch.setattr(kernels, "get", lambda: None)


# -- the proxy itself: it refuses what CUDA refuses, and only that ---------------------
def test_the_proxy_refuses_what_cuda_refuses():
    with FakeCuda(count=2) as gpu:
        x = torch.randn(3, 4).to("cuda")
        cpu_rows = torch.tensor([0, 2])
        refused = {
            "index_select": lambda: x.index_select(0, cpu_rows),
            "add": lambda: x + torch.ones(4),
            "masked_fill": lambda: x.masked_fill(torch.zeros(3, 4, dtype=torch.bool), 0),
            "index_copy_": lambda: x.index_copy_(0, cpu_rows, x[:2]),
            "cat": lambda: torch.cat([x, torch.ones(1, 4)]),
            "two gpus": lambda: x + x.to("cuda:1"),
            "generator": lambda: torch.multinomial(x.softmax(-1), 1, generator=torch.Generator()),
        }
        for name, op in refused.items():
            with pytest.raises(DeviceMismatch):
                op()
                pytest.fail(f"{name} passed")
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        # what CUDA allows: CPU scalars, CPU indices, copies both ways
        assert on_device(x * torch.tensor(2.0)) and on_device(x[cpu_rows])
        x[cpu_rows] = 0.0
        x[0] = torch.ones(4)
        assert torch.equal(x.cpu()[0], torch.ones(4)) and not on_device(x.cpu())
        assert x.device == torch.device("cuda", 0) and x.is_cuda and torch.cuda.is_available()
        assert gpu.host_reads == ["cpu", "cpu"]
        g = torch.Generator(device="cuda").manual_seed(0)
        assert on_device(torch.multinomial(x.softmax(-1), 1, generator=g))


# -- the LLM engine -------------------------------------------------------------------
PROMPTS = MIXED[1:4]  # 17, 40 and 64 tokens: chunked prefills beside decodes


@pytest.mark.parametrize("name", MODELS)
def test_engine_steps_on_cuda_are_token_exact(model_dirs, name, no_kernels):
    """Chunked prefill and decode of a mixed batch, the pool, RoPE and weights on cuda,
    greedy tokens equal to transformers'."""
    with FakeCuda() as gpu:
        engine = LLMEngine(
            model_dirs[name], device="cuda", dtype="float32", num_kv_blocks=64,
            max_num_batched_tokens=16,
        )  # fmt: skip
        runner = engine.runner
        assert runner.kernels is None
        assert all(on_device(p) for p in runner.model.parameters())
        assert all(on_device(t) for a in runner.attentions for t in a.kv_cache)
        outputs = generate(engine, PROMPTS)
    assert gpu.ops > 0
    assert_parity(model_dirs[name], PROMPTS, outputs)


SAMPLED = SamplingParams(
    temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=8,
    logprobs=3, prompt_logprobs=2, presence_penalty=0.5, frequency_penalty=0.2,
    repetition_penalty=1.1,
)  # fmt: skip


def run_requests(folder: Path, device: str, params: SamplingParams, prompts=MIXED[:3]):
    engine = LLMEngine(folder, device=device, dtype="float32", num_kv_blocks=64)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def test_seeded_sampling_on_cuda_equals_the_cpu_run(llama_dir, no_kernels):
    """Seeds, top-k/p, min-p, penalties, logprobs and prompt logprobs: on cuda the same
    tokens and log-probabilities as the CPU run (the pretend generator draws the CPU's
    stream)."""
    with FakeCuda():
        on_gpu = run_requests(llama_dir, "cuda", SAMPLED)
    on_cpu = run_requests(llama_dir, "cpu", SAMPLED)
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        assert gpu.error is None
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
        assert gpu.outputs[0].logprobs == cpu.outputs[0].logprobs  # the same CPU arithmetic
        assert gpu.prompt_logprobs == cpu.prompt_logprobs


def test_grammar_masks_apply_to_cuda_logits():
    """`apply_masks` on cuda logits: refused tokens to -inf, as on the CPU."""
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 2), dtype=torch.int32)
    want = logits.clone()
    apply_masks(want, [0, 2], bitmask)
    with FakeCuda():
        got = logits.to("cuda")
        apply_masks(got, [0, 2], bitmask)
        assert on_device(got)
        assert torch.equal(host(got), want)


def test_guided_requests_on_cuda(llama_dir, no_kernels):
    """A guided choice through a whole engine on cuda ends in one of the choices, as on
    the CPU (today the mix-up fails the step, outside the step's fault isolation)."""
    params = SamplingParams(guide=Guide.choice(["yes", "no"]), temperature=0, max_tokens=8)
    with FakeCuda():
        on_gpu = run_requests(llama_dir, "cuda", params, MIXED[:2])
    on_cpu = run_requests(llama_dir, "cpu", params, MIXED[:2])
    assert [o.outputs[0].token_ids for o in on_gpu] == [o.outputs[0].token_ids for o in on_cpu]


def test_grammar_bitmask_is_built_on_the_host():
    """llguidance fills its bitmask on the CPU; the sampler owns moving it (see above)."""
    assert mask_rows([], 64).device.type == "cpu"


# -- diffusion ------------------------------------------------------------------------
def test_diffusion_steps_on_cuda_equal_the_cpu(denoiser):
    """Guided and unguided rows, DDIM and DDPM (eta 1), a step batch on cuda: the images
    the CPU makes, bit for bit."""
    from bitserve.diffusion.engine import DiffusionEngine
    from bitserve.diffusion.params import GenerationParams

    model, schedule = denoiser

    def images(device: str):
        engine = DiffusionEngine(copy.deepcopy(model).to(device), schedule, max_rows=8)
        rows = [
            engine.submit(GenerationParams(label=3, steps=3, guidance_scale=2.0, seed=1)),
            engine.submit(GenerationParams(label=None, steps=2, seed=2, eta=1.0)),
            engine.submit(GenerationParams(label=7, steps=2, guidance_scale=0.0, seed=3)),
        ]
        while engine.step():
            pass
        return [row.future.result() for row in rows]

    with FakeCuda() as gpu:
        on_gpu = images("cuda")
    assert gpu.ops > 0
    for got, want in zip(on_gpu, images("cpu"), strict=True):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def denoiser():
    from bitserve.diffusion.evaluate import weights_path
    from bitserve.diffusion.unet import load_denoiser
    from tests.diffusion.conftest import DIGITS

    return load_denoiser(weights_path(DIGITS))


# -- the backends ---------------------------------------------------------------------
def test_torch_backend_forward_on_cuda(tmp_path):
    from bitserve.backends.torch import TorchModel
    from tests.backends.test_torch import FP32_X, FP32_Y, Mlp, export, make_config

    torch.manual_seed(0)
    module = Mlp().eval()
    export(module, (torch.randn(2, 6),), tmp_path / "model.pt2")
    x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
    with FakeCuda():
        model = TorchModel(make_config(FP32_X, FP32_Y), tmp_path, device="cuda")
        model.load()
        out = model.predict({"x": x})["y"]
        assert on_device(out)
        y = coerce(out, "FP32")  # the batcher's split: to the host, then numpy
    np.testing.assert_allclose(y, module(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)


def test_hf_backend_forward_on_cuda(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from bitserve.backends.hf import HfModel
    from tests.backends.test_hf import (
        CLASSIFIER_OUTPUTS,
        MINILM,
        TEXTS,
        classifier_config,
        texts_array,
    )

    tokenizer = AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = BertForSequenceClassification(config).eval()
    reference.save_pretrained(tmp_path / "weights")
    tokenizer.save_pretrained(tmp_path / "weights")
    (tmp_path / "1").mkdir()
    with FakeCuda():
        model = HfModel(classifier_config(CLASSIFIER_OUTPUTS), tmp_path / "1", device="cuda")
        model.load()
        assert all(on_device(p) for p in model.model.parameters())
        out = {k: coerce(v, "BYTES" if k == "label" else "FP32") for k, v in model.predict(
            {"text": texts_array(TEXTS)}
        ).items()}  # fmt: skip
    tokens = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        logits = reference(**tokens).logits
    np.testing.assert_allclose(out["logits"], logits.numpy(), atol=1e-5, rtol=1e-5)


def test_diffusion_backend_forward_on_cuda():
    """The backend's engine (its own step thread) on cuda: the CPU's images."""
    from bitserve.backends.diffusion import DiffusionModel
    from bitserve.config import load_config
    from tests.diffusion.conftest import DIGITS

    config = load_config(DIGITS / "config.toml")
    inputs = {
        "label": np.array([[3], [-1]], np.int32),
        "steps": np.array([[2], [2]], np.int32),
        "seed": np.array([[1], [2]], np.int64),
    }

    def images(device: str) -> np.ndarray:
        model = DiffusionModel(config, DIGITS / "1", device=device)
        model.load()
        try:
            return model.predict(inputs)["image"]
        finally:
            model.unload()

    with FakeCuda():
        on_gpu = images("cuda")
    # the same float arithmetic up to its last bits (the step thread's reductions may
    # split differently between runs), quantized to uint8: a pixel that lands on a .5
    # boundary may move by one level; a wrong seed, label or schedule moves hundreds
    diff = np.abs(on_gpu.astype(np.int16) - images("cpu").astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_llm_backend_serves_on_cuda(llama_dir, no_kernels):
    """The llm backend's service (engine loop on its own thread, warm-up, v2 infer) on
    cuda: the CPU's text for a greedy and a seeded request."""
    import asyncio

    from bitserve.backends.llm import LLMService
    from bitserve.config import ModelConfig

    inputs = [
        {"text_input": np.array([b"the cat"], dtype=object)},
        {
            "text_input": np.array([b"a dog ran"], dtype=object),
            "sampling_parameters": np.array(
                [b'{"temperature": 0.7, "seed": 3, "max_tokens": 6}'], dtype=object
            ),
        },
    ]

    def texts(device: str) -> list[bytes]:
        parameters = {"num_kv_blocks": 32, "device": device, "dtype": "float32"}
        config = ModelConfig.model_validate(
            {"name": "m", "backend": "llm", "parameters": parameters}
        )

        async def go():
            svc = LLMService(config, llama_dir)
            await svc.start()
            try:
                return [
                    (await svc.text_output(svc.text_request(x)))["text_output"][0] for x in inputs
                ]
            finally:
                await svc.stop()

        return asyncio.run(go())

    with FakeCuda() as gpu:
        on_gpu = texts("cuda")
    assert gpu.ops > 0
    assert all(on_gpu) and on_gpu == texts("cpu")
