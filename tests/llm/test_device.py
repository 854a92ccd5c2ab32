"""`EngineConfig.device` and the path a GPU takes, exercised on the CPU.

On cuda the C kernels are never used: every attention goes through the torch paths
(or flash-attn when it imports). Forcing `kernels.get()` to None runs that same code
on the CPU, so token-exactness there covers the control flow a GPU run takes.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bitserve import kernels
from bitserve.llm.attention import FlashAttn
from bitserve.llm.config import EngineConfig
from tests.llm.conftest import make_engine
from tests.llm.test_engine import GREEDY, MIXED, assert_parity, generate


def test_device_auto_resolves_to_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda:1")


def test_device_auto_picks_cuda_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(num_kv_blocks=4)  # no free-GPU-memory query
    assert config.device == "cuda" and not config.on_cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_is_cpu_here():
    config = EngineConfig()
    assert config.device == "cpu" and config.on_cpu


@pytest.mark.parametrize("device", ["gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "mps", "", 0])
def test_device_is_validated(device):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=device)


def test_explicit_cpu_without_kernels_is_token_exact(llama_dir, monkeypatch):
    """The no-kernel path (the one cuda takes) stays token-exact, chunks included."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    runner = engine.runner
    assert runner.kernels is None and runner.flash is None
    k_pool, _ = runner.attentions[0].kv_cache
    assert k_pool.device.type == "cpu" and k_pool.dtype is torch.float32
    assert runner.model.rotary.cos.device.type == "cpu"
    assert_parity(llama_dir, MIXED, generate(engine, MIXED))


def bottom_right_sdpa(q, k, v, scale):
    """q [n, Hq, D] against k, v [L, Hkv, D]; query i sees keys up to L - n + i."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    o = F.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


class FakeFlashAttn:
    """flash-attn's two entry points, with their argument layouts, done with SDPA."""

    def __init__(self):
        self.calls = {"varlen": 0, "with_kvcache": 0}

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
        self.calls["varlen"] += 1
        assert causal and cu_q.dtype is torch.int32 and q.dim() == 3
        assert all(t.stride(-1) == 1 for t in (q, k, v))
        outs = []
        for i in range(len(cu_q) - 1):
            rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            outs.append(bottom_right_sdpa(q[rows_q], k[rows_k], v[rows_k], softmax_scale))
        return torch.cat(outs)

    def with_kvcache(self, q, k_cache, v_cache, softmax_scale=None, causal=False):
        self.calls["with_kvcache"] += 1
        assert causal and q.dim() == 4 and k_cache.dim() == 4
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert q.shape[2] % k_cache.shape[2] == 0 and k_cache.shape[1] >= q.shape[1]
        return torch.stack(
            [bottom_right_sdpa(q[b], k_cache[b], v_cache[b], softmax_scale) for b in range(len(q))]
        )


def test_flash_attn_plumbing_is_token_exact(llama_dir, monkeypatch):
    """The flash-attn calls (shapes, strides, causal alignment) through a SDPA stand-in."""
    monkeypatch.setattr(kernels, "get", lambda: None)
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    fake = FakeFlashAttn()
    engine.runner.flash = FlashAttn(fake.varlen, fake.with_kvcache)
    assert_parity(llama_dir, MIXED, generate(engine, MIXED, GREEDY))
    assert fake.calls["varlen"] > 0 and fake.calls["with_kvcache"] > 0


def test_flash_attn_is_never_picked_on_cpu(llama_dir):
    engine = make_engine(llama_dir, device="cpu", num_kv_blocks=8)
    assert engine.runner.flash is None


# -- GPU-sized defaults, with torch.cuda's answers monkeypatched ------------------------
GIB = 1 << 30


@pytest.fixture
def one_gpu(monkeypatch):
    """torch sees one 141 GiB GPU with 140 GiB free (an H200 as the lent one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * GIB, 141 * GIB))
    return monkeypatch


def folder_with(tmp_path, llama_dir, **changes):
    """llama_dir's config.json with `changes` (no weights: only the config is read)."""
    hf = json.loads((llama_dir / "config.json").read_text())
    hf.pop("torch_dtype", None), hf.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(hf | changes))
    return tmp_path


@pytest.mark.parametrize(
    ("stored", "picked"),
    [("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float16", "float16"), (None, "bfloat16")],
)
def test_auto_dtype_on_a_gpu_is_the_checkpoints_half_type_else_bf16(
    one_gpu, tmp_path, llama_dir, stored, picked
):
    for key in ("torch_dtype", "dtype"):  # transformers < 5 and >= 5 write these
        folder = folder_with(tmp_path, llama_dir, **{key: stored})
        config = EngineConfig(folder, device="cuda", num_kv_blocks=4)
        assert config.dtype == picked and config.torch_dtype is getattr(torch, picked)
    assert EngineConfig(folder, device="cuda", num_kv_blocks=4, dtype="float32").dtype == "float32"
    assert EngineConfig(folder, device="cuda", num_kv_blocks=4, dtype="fp16").dtype == "float16"


def test_auto_dtype_stays_float32_on_the_cpu(tmp_path, llama_dir):
    folder = folder_with(tmp_path, llama_dir, torch_dtype="bfloat16")
    assert EngineConfig(folder, device="cpu", num_kv_blocks=4).dtype == "float32"
    assert EngineConfig(device="cpu").dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(device="cpu", dtype="int8")


def test_tf32_is_on_for_a_cuda_engine_only(llama_dir, monkeypatch):
    from tests.fakedevice import FakeCuda

    monkeypatch.setattr(kernels, "get", lambda: None)
    matmul = torch.backends.cuda.matmul
    assert matmul.allow_tf32 is False  # torch's default: full fp32
    try:
        make_engine(llama_dir, device="cpu", num_kv_blocks=8)
        assert matmul.allow_tf32 is False
        with FakeCuda():
            make_engine(llama_dir, device="cuda", num_kv_blocks=8)
            assert matmul.allow_tf32 is True
        assert matmul.allow_tf32 is False  # FakeCuda puts torch's flags back
    finally:
        matmul.allow_tf32 = False


def test_max_num_batched_tokens_default_follows_the_device(one_gpu):
    assert EngineConfig(device="cpu").max_num_batched_tokens == 2048
    assert EngineConfig(device="cuda", num_kv_blocks=4).max_num_batched_tokens == 8192
    given = EngineConfig(device="cuda", num_kv_blocks=4, max_num_batched_tokens=512)
    assert given.max_num_batched_tokens == 512


def test_the_gpu_kv_pool_is_what_gpu_memory_utilization_leaves(one_gpu, llama_dir):
    """vLLM's reading: 0.9 of the GPU's total, less what is in use (1 GiB here), the
    weights (the parameters transformers counts, in bf16) and a step's activations;
    no 8 GiB cap."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir)
    weights = sum(p.numel() for p in hf.parameters()) * 2
    config = EngineConfig(llama_dir, device="cuda")
    h, inner, vocab = 64, 128, 384  # tests/llm/conftest.py llama_config
    step = 8192 * (6 * h + 3 * inner) * 2 + 256 * vocab * 8
    assert config.kv_cache_memory == int(0.9 * 141 * GIB) - GIB - weights - step
    assert config.kv_cache_memory > 8 * GIB
    half = EngineConfig(llama_dir, device="cuda", gpu_memory_utilization=0.5)
    assert config.kv_cache_memory - half.kv_cache_memory == int(0.9 * 141 * GIB) - int(
        0.5 * 141 * GIB
    )
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.001 .* leaves no KV cache"):
        EngineConfig(llama_dir, device="cuda", gpu_memory_utilization=0.001)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be"):
            EngineConfig(device="cuda", num_kv_blocks=4, gpu_memory_utilization=bad)
    assert EngineConfig(llama_dir, device="cuda", kv_cache_memory=GIB).kv_cache_memory == GIB


def test_the_runner_sizes_its_cuda_pool_from_that_budget(llama_dir, monkeypatch):
    from tests.fakedevice import FakeCuda, on_device

    monkeypatch.setattr(kernels, "get", lambda: None)
    with FakeCuda(total=48 << 20, free=46 << 20):  # a tiny GPU: a small pool in CPU memory
        engine = make_engine(llama_dir, device="cuda", dtype="float32")
        runner = engine.runner
        assert runner.num_blocks == engine.config.kv_cache_memory // runner.bytes_per_block()
        assert runner.num_blocks > 0 and on_device(runner.attentions[0].kv_cache[0])


def test_tensor_parallel_ranks_get_a_gpu_each(one_gpu, llama_dir):
    with pytest.raises(ValueError, match=r"needs 2 GPUs.*torch sees 1; ranks never share"):
        EngineConfig(llama_dir, device="cuda", tensor_parallel_size=2, num_kv_blocks=4)
    one_gpu.setattr(torch.cuda, "device_count", lambda: 4)
    config = EngineConfig(llama_dir, device="cuda:1", tensor_parallel_size=2, num_kv_blocks=4)
    assert [config.rank_device(r) for r in range(2)] == ["cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match=r"needs 4 GPUs, one a rank \(cuda:1..cuda:4\)"):
        EngineConfig(
            llama_dir, device="cuda:1", tensor_parallel_size=2, pipeline_parallel_size=2,
            num_kv_blocks=4,
        )  # fmt: skip
    ray = EngineConfig(
        llama_dir, device="cuda", tensor_parallel_size=2, distributed_executor="ray",
        num_kv_blocks=4,
    )  # fmt: skip
    assert ray.rank_device(1) == "cuda:0"  # the one GPU Ray shows the actor
    cpu = EngineConfig(llama_dir, device="cpu", tensor_parallel_size=2, num_kv_blocks=4)
    assert cpu.rank_device(1) == "cpu"
