"""AWQ and GPTQ checkpoints (llm/quant/checkpoints.py) built here, from the formats'
specification, against transformers on their dequantized fp32 weights.

Each checkpoint comes from a random-weight Llama, Qwen2 or Qwen3: every decoder linear is
quantized (4-bit, per group, fp16 scales, integer zeros; GPTQ act-order with a random
g_idx shared by the parts bitserve fuses, as GPTQ's shared inputs make it) and packed as
AutoAWQ's GEMM layers and AutoGPTQ/GPTQModel's layers lay it out; the other tensors are
stored fp16, as such checkpoints are. The reference is transformers' model with those
fp16 tensors and each linear's weight dequantized by `spec_dequantize`, which reads the
packed tensors position by position, written from the specification apart from
bitserve's unpacking (transformers cannot dequantize AWQ/GPTQ on the CPU without
autoawq/gptqmodel, which need CUDA to install).

Tolerances: the int4 kernel quantizes x to int8 in blocks of 32 (in the stored column
order); one layer is held to exactly that arithmetic (`test_unpacking_...`, 1e-4). A
whole model cannot be: an x within fp32 noise of an int8 rounding boundary rounds the
other way (about one element a layer here) and the jump of amax / 127 carries. So the
models are initialised as transformers does (std 0.02; the shared tests' 0.2 makes these
nets chaotic enough that int8 x alone moves log-probabilities by 0.2-0.4 and flips
greedy tokens), where x's int8 rounding moves log-probabilities by <= 4.4e-3 (their
spread over the vocabulary: std 0.22); the tolerance is 1e-2, and a checkpoint read
with its zeros off by one (v2 read as v1) lands far outside it. Greedy tokens over 16
steps equal the reference's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from bitserve import kernels
from bitserve.llm import LLM, SamplingParams
from bitserve.llm.quant import checkpoints
from bitserve.llm.quant.linear import Int4CheckpointLinear
from tests.llm.conftest import COMMON, build_model, make_engine
from tests.llm.test_engine import MIXED
from tests.quant.test_kernels import blockwise_int8

needs_kernels = pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")
STEPS = 16
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
BASE = COMMON | {"initializer_range": 0.02}  # transformers' default (see the docstring)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SHAPE, **BASE),
    "qwen2": lambda: Qwen2Config(**SHAPE, tie_word_embeddings=True, **BASE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32, **BASE),
}
LOGPROB_TOL = 1e-2
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}


# -- the formats, from their specification --------------------------------------------------
def pack8(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes 0..15 -> int32 [...], code j in bits 4j .. 4j + 3."""
    value = sum(codes[..., j].long() << (4 * j) for j in range(8))
    return (value - (value >= 2**31).long() * 2**32).to(torch.int32)


def quantize(w, group, g_idx, sym):
    """w [out, in] -> q [out, in], zero [out, groups] (integers), scale [out, groups] fp16."""
    groups = w.shape[1] // group
    q = torch.zeros_like(w, dtype=torch.int64)
    zero = torch.zeros(w.shape[0], groups, dtype=torch.int64)
    scale = torch.zeros(w.shape[0], groups, dtype=torch.float16)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s, z = (cols.abs().amax(1) / 7.5).half(), torch.full((w.shape[0],), 8)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half()
            z = torch.round(-lo / s.float()).long().clamp(0, 15)
        q[:, g_idx == g] = (torch.round(cols / s.float()[:, None]) + z[:, None]).clamp(0, 15).long()
        zero[:, g], scale[:, g] = z, s
    return q, zero, scale


def pack_awq(q, zero, scale) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: along the outputs, code j of an int32 is output AWQ_ORDER[j]."""

    def along_out(t):  # [rows, out] -> [rows, out / 8]
        return pack8(t.view(t.shape[0], -1, 8)[..., AWQ_ORDER])

    return {"qweight": along_out(q.t()), "qzeros": along_out(zero.t()), "scales": scale.t()}


def pack_gptq(q, zero, scale, g_idx, v1) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight along the inputs, qzeros along the outputs in order; v1
    stores each zero minus one (a nibble: 0 would wrap, these quantizers never make it)."""
    k, n = q.shape[1], q.shape[0]
    qweight = pack8(q.t().reshape(k // 8, 8, n).permute(0, 2, 1))
    stored = (zero.t() - 1) & 15 if v1 else zero.t()
    qzeros = pack8(stored.reshape(stored.shape[0], -1, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t(), "g_idx": g_idx.int()}


def pack(method, q, zero, scale, g_idx, v1) -> dict[str, torch.Tensor]:
    return pack_awq(q, zero, scale) if method == "awq" else pack_gptq(q, zero, scale, g_idx, v1)


def code(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return (packed.long() >> (4 * index)) & 15


def spec_dequantize(method, parts, v1=True) -> torch.Tensor:
    """W [out, in] in fp32, element by element as the specification reads: AWQ
    W[n, k] = (code(qweight[k, n / 8], slot(n)) - code(qzeros[k / g, n / 8], slot(n))) *
    scales[k / g, n] with slot(n) the position of n % 8 in AWQ_ORDER; GPTQ
    W[n, k] = (code(qweight[k / 8, n], k % 8) - zero) * scales[g_idx[k], n], zero =
    code(qzeros[g_idx[k], n / 8], n % 8) (+ 1 in v1)."""
    scales = parts["scales"].float()
    n_out = scales.shape[1]
    n = torch.arange(n_out)[:, None]
    if method == "awq":
        k = torch.arange(parts["qweight"].shape[0])[None, :]
        g = k // (k.shape[1] // scales.shape[0])
        slot = torch.tensor([AWQ_ORDER.index(i) for i in range(8)])[n % 8]
        q = code(parts["qweight"][k, n // 8], slot)
        zero = code(parts["qzeros"][g, n // 8], slot)
    else:
        k = torch.arange(parts["qweight"].shape[0] * 8)[None, :]
        g = parts["g_idx"].long()[k]
        q = code(parts["qweight"][k // 8, n], k % 8)
        zero = code(parts["qzeros"][g, n // 8], n % 8) + (1 if v1 else 0)
    return (q - zero).float() * scales[g, n]


# -- checkpoint folders ---------------------------------------------------------------------
VARIANTS = {  # quantization_config, and how the test quantizes
    "awq-g128": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                  "zero_point": True}, False, False),
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "GEMM",
                 "zero_point": True}, False, False),
    "gptq-sym-g64": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                      "sym": True}, True, False),
    "gptq-actorder-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                           "desc_act": True, "sym": False, "checkpoint_format": "gptq"},
                          False, True),
    "gptq-v2-actorder-g128": ({"quant_method": "gptq", "bits": 4, "group_size": 128,
                               "desc_act": True, "sym": True, "checkpoint_format": "gptq_v2"},
                              True, True),
    "gptq-one-group": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                        "sym": False}, False, False),
}  # fmt: skip


def g_index(width, group, act_order, gen):
    """Each input's group: in order, or (act-order) a random permutation of that."""
    plain = torch.arange(width) // group
    if not act_order:
        return plain
    g_idx = torch.empty_like(plain)
    g_idx[torch.randperm(width, generator=gen)] = plain
    return g_idx


def build(tmp_path, family, variant):
    """(checkpoint folder, reference folder): the same model, quantized and dequantized."""
    qconfig, sym, act = VARIANTS[variant]
    source = build_model(tmp_path / "source", FAMILIES[family]())
    hf = AutoModelForCausalLM.from_pretrained(source).eval()
    gen = torch.Generator().manual_seed(5)
    state = {k: v.half() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]
    orders: dict[tuple, torch.Tensor] = {}
    method = qconfig["quant_method"]
    for name, module in hf.named_modules():
        part = name.rpartition(".")[2]
        if part not in LINEARS:
            continue
        width = module.in_features
        group = width if qconfig["group_size"] == -1 else qconfig["group_size"]
        key = (name.rpartition(".")[0], INPUTS.get(part, part))  # fused parts share g_idx
        g_idx = orders.setdefault(key, g_index(width, group, act, gen))
        q, zero, scale = quantize(module.weight.detach(), group, g_idx, sym)
        v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
        packed = pack(method, q, zero, scale, g_idx, v1)
        del state[f"{name}.weight"]
        state |= {f"{name}.{k}": v.contiguous() for k, v in packed.items()}
        module.weight.data = spec_dequantize(method, packed, "v2" not in variant)
    for name, tensor in hf.state_dict().items():  # the checkpoint's fp16 values
        if not any(f".{part}.weight" in name for part in LINEARS):
            tensor.copy_(tensor.half().float())
    reference = tmp_path / "reference"
    hf.save_pretrained(reference)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy(f, folder / f.name)
    config = json.loads((source / "config.json").read_text())
    config |= {"quantization_config": qconfig, "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))
    return folder, reference, hf


def run(engine, prompt):
    llm = LLM.__new__(LLM)
    llm.engine = engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    return llm.generate([prompt], params)[0].outputs[0]


def reference_run(hf, prompt, tokens=None):
    """transformers' greedy tokens, and its log-probabilities along `tokens` (default:
    its own), so that both sides are read on the same sequence."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
        greedy = out[0, len(prompt) :].tolist()
        seq = torch.tensor([prompt + (tokens or greedy)[:-1]])
        logprobs = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1 :], -1)
    return greedy, logprobs


def max_gap(out, logprobs) -> float:
    return max(
        abs(value - float(logprobs[step, token]))
        for step, entry in enumerate(out.logprobs)
        for token, value in entry.items()
    )


CASES = [(f, v) for v in VARIANTS for f in ["llama"]] + [
    ("qwen2", "awq-g128"),
    ("qwen2", "gptq-actorder-g32"),
    ("qwen3", "gptq-v2-actorder-g128"),
]


@needs_kernels
@pytest.mark.parametrize("family,variant", CASES)
def test_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path, family, variant):
    folder, reference, _ = build(tmp_path, family, variant)
    engine = make_engine(folder, num_kv_blocks=64)
    model = engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4CheckpointLinear)
    assert model.fuse_rows > 0  # decode runs the fused C layer over these weights
    out = run(engine, MIXED[2])
    hf = AutoModelForCausalLM.from_pretrained(reference).eval()
    tokens, logprobs = reference_run(hf, MIXED[2], out.token_ids)
    assert out.token_ids == tokens
    assert max_gap(out, logprobs) < LOGPROB_TOL


@needs_kernels
def test_zeros_off_by_one_are_outside_the_tolerance(tmp_path):
    """The check above can fail: a gptq_v2 checkpoint read as v1 (every zero + 1)."""
    folder, reference, _ = build(tmp_path, "llama", "gptq-v2-actorder-g128")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq"
    (folder / "config.json").write_text(json.dumps(config))
    out = run(make_engine(folder, num_kv_blocks=64), MIXED[2])
    hf = AutoModelForCausalLM.from_pretrained(reference).eval()
    assert max_gap(out, reference_run(hf, MIXED[2], out.token_ids)[1]) > 5 * LOGPROB_TOL


@pytest.fixture
def no_kernels():
    kernels.reset(enabled=False)
    yield
    kernels.reset()


def test_without_kernels_the_fp32_dequantized_weights_run(tmp_path, no_kernels):
    folder, reference, _ = build(tmp_path, "llama", "gptq-actorder-g32")
    out = run(make_engine(folder, num_kv_blocks=64), MIXED[1])
    hf = AutoModelForCausalLM.from_pretrained(reference).eval()
    tokens, logprobs = reference_run(hf, MIXED[1], out.token_ids)
    assert out.token_ids == tokens
    assert max_gap(out, logprobs) < 1e-4  # fp32 x, fp32 weights: the fp32 parity tolerance


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unpacking_is_the_specification_exactly(variant):
    """bitserve's layer dequantizes to the spec's W bit for bit: fp32 scales and zeros
    carry the fp16 scales with no rounding (bf16 ones would lose 3 bits)."""
    qconfig, sym, act = VARIANTS[variant]
    gen = torch.Generator().manual_seed(1)
    k, n = 256, 48
    group = k if qconfig["group_size"] == -1 else qconfig["group_size"]
    g_idx = g_index(k, group, act, gen)
    q, zero, scale = quantize(torch.randn(n, k, generator=gen), group, g_idx, sym)
    method = qconfig["quant_method"]
    v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
    parts = pack(method, q, zero, scale, g_idx, v1)
    layer = Int4CheckpointLinear(k, n, False, group)
    checkpoints.fill(layer, method, [parts], method == "gptq" and v1)
    want = spec_dequantize(method, parts, v1)
    assert torch.equal(layer.dequantize()[:, :k], want)
    assert (layer.perm is not None) == act
    if kernels.get() is not None:  # and the kernel multiplies by exactly that
        layer.prepare()
        x = torch.randn(3, k, generator=gen)
        xs = blockwise_int8(x[:, layer.perm.long()]) if act else blockwise_int8(x)
        w = want[:, layer.perm.long()] if act else want
        torch.testing.assert_close(layer.matmul(x), F.linear(xs, w), rtol=1e-4, atol=1e-4)


REFUSED = [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
     "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "group_size"),
]  # fmt: skip


@pytest.mark.parametrize("qconfig,field", REFUSED)
def test_other_formats_are_refused_naming_the_field(qconfig, field):
    with pytest.raises(ValueError, match=rf"quantization_config\.{field} ="):
        checkpoints.check(qconfig)


def test_a_refused_checkpoint_fails_at_load(tmp_path):
    folder, _, _ = build(tmp_path, "llama", "awq-g128")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.bits = 8"):
        LLM(folder, num_kv_blocks=8)
