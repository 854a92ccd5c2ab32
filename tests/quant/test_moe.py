"""Quantized MoE experts: Mixtral and Qwen3-MoE keep their perplexity under int8 and int4.

A MoE with a real perplexity, offline: tinylm "upcycled" (its trained MLP copied into
every expert, a small random router). Mixtral's upcycle computes what tinylm does
(renormalised top-2 weights sum to 1 over identical experts); Qwen3-MoE's adds qk-norm
with unit weights, so it is a different model with a higher perplexity, compared with
its own fp32 self. The limits are the dense ones (test_tinylm.py): int8 within 1%,
int4 (group 32) within 5%.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bitserve.llm import LLM, SamplingParams
from bitserve.llm.quant.linear import Int4Linear, Int8Linear
from bitserve.plan import memory, shape
from bitserve.quantize.command import _quantize_llm
from bitserve.quantize.evaluate import score_llm
from bitserve.quantize.folders import Source
from tests.quant.conftest import HELDOUT, TINYLM

EXPERTS = 4
MLP = ("gate_proj", "up_proj", "down_proj")
NAMES = {
    "mixtral": ("block_sparse_moe", dict(gate_proj="w1", up_proj="w3", down_proj="w2")),
    "qwen3_moe": ("mlp", {name: name for name in MLP}),
}


def upcycle(folder, arch: str):
    """tinylm with its MLP in every expert of `arch`'s MoE layers."""
    folder.mkdir(parents=True)
    for companion in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINYLM / "1" / companion, folder / companion)
    config = json.loads((TINYLM / "1" / "config.json").read_text())
    config.update(num_experts_per_tok=2)
    if arch == "mixtral":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        config.update(num_local_experts=EXPERTS)
    else:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
        config.update(num_experts=EXPERTS, moe_intermediate_size=config["intermediate_size"])
        config.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    (folder / "config.json").write_text(json.dumps(config))
    block, renames = NAMES[arch]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    with safe_open(str(TINYLM / "1" / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            tensor = f.get_tensor(name)
            part = name.rsplit(".", 2)[-2]
            if ".mlp." not in name:
                tensors[name] = tensor
                if arch == "qwen3_moe" and name.endswith("self_attn.q_proj.weight"):
                    norm = name.replace("q_proj.weight", "q_norm.weight")
                    tensors[norm] = torch.ones(config["head_dim"])
                    tensors[norm.replace("q_norm", "k_norm")] = torch.ones(config["head_dim"])
                continue
            layer = name[: name.index(".mlp.")]
            for e in range(EXPERTS):
                tensors[f"{layer}.{block}.experts.{e}.{renames[part]}.weight"] = tensor.clone()
            router = torch.randn(EXPERTS, config["hidden_size"], generator=g) * 0.02
            tensors[f"{layer}.{block}.gate.weight"] = router
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    folders = {}
    for arch in NAMES:
        source = upcycle(root / arch, arch)
        folders[arch, "fp32"] = source
        for method in ("int8", "int4"):
            out = root / f"{arch}-{method}"
            _quantize_llm(Source(source, "llm"), out, method, 32, 6.0, None, 0, None)
            folders[arch, method] = out
    return folders


@pytest.fixture(scope="module")
def perplexities(moe_folders) -> dict:
    """Held-out perplexity of every folder, each scored once (512 tokens)."""
    text = HELDOUT.read_text()
    return {key: score_llm(path, key[1], text, 256, 512, 4) for key, path in moe_folders.items()}


@pytest.mark.parametrize("arch", list(NAMES))
@pytest.mark.parametrize(("method", "limit"), [("int8", 0.01), ("int4", 0.05)])
def test_quantized_experts_keep_the_perplexity(perplexities, arch, method, limit):
    ref, quantized = perplexities[arch, "fp32"], perplexities[arch, method]
    change = quantized.perplexity / ref.perplexity - 1
    print(arch, method, f"ppl {ref.perplexity:.2f} change {change:+.4%}")
    assert abs(change) < limit
    assert quantized.weight_bytes / ref.weight_bytes < (0.3 if method == "int8" else 0.2)


@pytest.mark.parametrize("arch", list(NAMES))
def test_quantized_experts_serve(moe_folders, arch):
    llm = LLM(moe_folders[arch, "int4"], num_kv_blocks=32)
    moe = llm.engine.runner.model.layers[0].mlp
    assert moe.w13 is None and all(type(layer) is Int4Linear for layer in moe.q13)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate("In the beginning", params)[0].outputs[0]
    assert len(out.token_ids) == 8
    assert sum(llm.engine.metrics().tokens_per_expert) > 0
    int8 = LLM(moe_folders[arch, "int8"], num_kv_blocks=32).engine.runner.model
    assert all(type(layer) is Int8Linear for layer in int8.layers[0].mlp.q2)


@pytest.mark.parametrize("arch", list(NAMES))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_plan_memory_quant_counts_quantized_experts(moe_folders, arch, method):
    """`bitserve plan memory --quant` predicts the quantized MoE the engine holds."""
    model = shape.from_config(shape.read_config(moe_folders[arch, "fp32"]))
    plan = memory.estimate(model, 8, 256, quant=method)
    measured = memory.measure(moe_folders[arch, method], 8, 256)
    assert plan.weights + plan.tables == pytest.approx(measured["other"], rel=0.10)
