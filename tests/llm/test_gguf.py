"""GGUF files written by llama.cpp's own converter and `llama-quantize`, served by the engine.

The converter (`convert_hf_to_gguf.py`) is llama.cpp's, installed by
tools/fetch_gguf_converter.py, and `llama-quantize` is built from the same llama.cpp by
tools/build_llama_quantize.sh (make runs both); without them these tests skip. Every
type a llama.cpp user downloads (Q4_K_M, Q5_K_M, Q6_K, Q4_0, Q5_0, Q8_0; F32, F16, BF16
and the converter's own Q8_0) is checked against llama.cpp's dequantized tensors run
through transformers (its GGUF loader dequantizes with gguf-py's `quants.dequantize`):
logits within 1e-3 of the largest, and 64 greedy tokens equal. The converter runs
unchanged on the weights; two of its checks are told about our offline tokenizers,
which it has never seen: its table of known BPE pre-tokenizers (ours split as GPT-2
does, "gpt-2"), and its SentencePiece attempt, which imports sentencepiece before it
looks for a tokenizer.model we do not have (it then falls back to tokenizer.json, as
it does without that import).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bitserve.llm import LLM, SamplingParams
from bitserve.llm.gguf import hf_name, unpermute
from bitserve.llm.quant.ggml import GgmlLinear
from bitserve.quantize.evaluate import evaluate_llm
from bitserve.quantize.scoring import window_logits
from tests.llm.conftest import COMMON, build_model, make_engine, record_decode_rows
from tests.llm.test_engine import MIXED, generate, reference
from tests.quant.conftest import HELDOUT, TINYLM
from tools.llama_cpp import CONVERTER, QUANTIZE, convert, convert_all, quantize

needs_converter = pytest.mark.skipif(
    not CONVERTER.is_file(),
    reason=f"llama.cpp's converter is not at {CONVERTER}: run tools/fetch_gguf_converter.py",
)


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BITSERVE_GGUF_CACHE", str(tmp_path / "gguf-cache"))


needs_quantize = pytest.mark.skipif(
    not CONVERTER.is_file() or not QUANTIZE.is_file(),
    reason=f"no llama.cpp converter at {CONVERTER} or no llama-quantize at {QUANTIZE}: "
    "run tools/fetch_gguf_converter.py and tools/build_llama_quantize.sh",
)


@pytest.fixture(scope="module")
def llama_f32(llama_dir, tmp_path_factory) -> Path:
    """The conftest Llama folder through llama.cpp's converter, F32 (once: ~7 s)."""
    return convert(llama_dir, "f32", tmp_path_factory.mktemp("gguf") / "llama-f32.gguf")


@needs_converter
def test_f32_gguf_gives_the_folders_greedy_tokens(llama_dir, llama_f32):
    file = llama_f32
    engine = make_engine(file, num_kv_blocks=64)
    assert engine.config.gguf_file == file
    outputs = generate(engine, MIXED)
    assert outputs == [reference(llama_dir, p) for p in MIXED]  # transformers on the folder
    text = "the quick brown fox jumps over the lazy dog"
    folder = make_engine(llama_dir, num_kv_blocks=8)
    assert engine.tokenizer.encode(text) == folder.tokenizer.encode(text)
    assert engine.eos_token_ids == folder.eos_token_ids


@needs_converter
def test_a_folder_holding_a_gguf_is_served_from_it(llama_dir, llama_f32, tmp_path):
    """backend = "llm" points at a version folder: one .gguf there and no config.json."""
    version = tmp_path / "1"
    version.mkdir()
    shutil.copy(llama_f32, version / "model.gguf")
    engine = make_engine(version, num_kv_blocks=64)
    assert generate(engine, MIXED[:2]) == [reference(llama_dir, p) for p in MIXED[:2]]


@needs_converter
def test_q8_0_gguf_keeps_tinylm_perplexity(tmp_path):
    """A trained model's Q8_0 file, served in its own blocks: llama.cpp's rounding only."""
    file = convert(TINYLM / "1", "q8_0", tmp_path / "tinylm-q8_0.gguf")
    result = evaluate_llm(file, TINYLM / "1", HELDOUT.read_text(), 256, 256, 2)
    change = result["comparison"]["perplexity_change"]
    print(f"tinylm Q8_0 GGUF: perplexity change {change:+.4%}")
    assert abs(change) < 0.005
    assert result["comparison"]["next_token_agreement"] > 0.97


# -- every type a llama.cpp user has, on a model whose rows are whole super-blocks --------
CONVERTED = ("f32", "f16", "bf16", "q8_0")  # the converter's own outtypes
QUANTIZED = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q5_0", "Q8_0")  # llama-quantize's
# the types each file holds (llama-quantize keeps the output matrix Q6_K below Q8_0)
BLOCK_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}
BLOCK_TYPES |= {"Q4_0": {"Q4_0", "Q6_K"}, "Q5_0": {"Q5_0", "Q6_K"}, "Q8_0": {"Q8_0"}}
BLOCK_TYPES["q8_0"] = {"Q8_0"}
LONG = 64  # greedy tokens compared
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def k_config(**overrides) -> LlamaConfig:
    """K-quants need rows of whole 256-weight super-blocks: hidden 256, MLP 512."""
    return LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{**COMMON, "initializer_range": 0.05, **overrides},
    )


@pytest.fixture(scope="module")
def k_files(tmp_path_factory) -> dict[str, Path]:
    """The random Llama through the converter (4 outtypes) and llama-quantize (6 types),
    once per module: ~15 s."""
    root = tmp_path_factory.mktemp("gguf-k")
    folder = build_model(root / "hf", k_config(), seed=3)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": CHAT}))
    files = convert_all(folder, {t: root / f"{t}.gguf" for t in CONVERTED})
    for kind in QUANTIZED:
        files[kind] = quantize(files["f32"], root / f"{kind}.gguf", kind)
    return files


def llama_cpp_reference(file: Path):
    """transformers on the file: llama.cpp's tensors dequantized by gguf-py."""
    return AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()


def block_types(model) -> set[str]:
    return {t for m in model.modules() if isinstance(m, GgmlLinear) for t in m.types}


@needs_quantize
@pytest.mark.parametrize("kind", CONVERTED + QUANTIZED)
def test_every_type_is_llama_cpps_dequantized_model(k_files, kind):
    file = k_files[kind]
    engine = make_engine(file, num_kv_blocks=64, gguf_activations="fp32")  # the parity path
    model = engine.runner.model
    # the blocks stay as the file has them (Q4_K_M mixes Q4_K and Q6_K); floats are fp32
    assert block_types(model) - {"F32", "F16"} == BLOCK_TYPES.get(kind, set())
    assert model.fuse_rows > 0  # decode runs the fused C layer over them
    assert engine.tokenizer.chat_template == CHAT  # from tokenizer.chat_template
    hf = llama_cpp_reference(file)
    prompt = MIXED[2]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=LONG, do_sample=False)
        want_logits = hf(torch.tensor([prompt])).logits[0].float()
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    assert generate(engine, [prompt], params)[0] == want[0, len(prompt) :].tolist()
    with torch.inference_mode():
        got = window_logits(model, prompt)
    error = float((got - want_logits).abs().max() / want_logits.abs().max())
    assert error < 1e-3, f"{kind}: logits off by {error:.2e} of the largest"


@needs_quantize
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_int8_activations_by_default(k_files, kind):
    """`bitserve serve FILE.gguf` as it comes: the block-format layers meet int8
    activations (llama.cpp's own scheme), their codes in tiles and the file's bytes
    dropped. x's rounding moves the logits a little off llama.cpp's dequantized model
    (transformers on gguf-py's tensors, fp32 x): within 3% of the largest, the greedy
    tokens mostly the same; "fp32" is the exact path (the test above)."""
    engine = make_engine(k_files[kind], num_kv_blocks=64)
    assert engine.config.gguf_activations == "int8"
    layers = [m for m in engine.runner.model.modules() if isinstance(m, GgmlLinear)]
    assert layers and all(m.activations == "int8" for m in layers)
    blocks = [(m, i) for m in layers for i, t in enumerate(m.types) if t not in ("F32", "F16")]
    assert blocks and all(i in m.tiles and m.parts()[i][1].numel() == 0 for m, i in blocks)
    hf = llama_cpp_reference(k_files[kind])
    prompt = MIXED[2]
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0].float()
        got = window_logits(engine.runner.model, prompt)
    error = float((got - want).abs().max() / want.abs().max())
    assert 1e-5 < error < 3e-2, f"{kind}: logits off by {error:.2e} of the largest"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@needs_quantize
def test_a_prompt_step_past_256_rows_runs_the_c_layer_on_tiles(k_files, monkeypatch):
    """int8 activations, every part on tiles: a burst of prompts whose step passes 256
    rows runs the C decoder layer (in chunks of FUSED_CHUNK rows), as bitserve's own int8
    does, rather than the torch path layer by layer. The same tile GEMMs either way; the
    C layer's norms, RoPE and attention round differently, so an activation may now and
    then round to the next int8 code: the prompt step's greedy tokens are the torch
    path's, and its top-5 logprobs nearer the torch path's than those are to the fp32-x
    path's in the median and at most twice its worst (x's rounding, the format's own
    error; a wrong row or chunk would be nats off; later steps of a random-weight model
    may flip a token on such a rounding)."""
    from bitserve.llm.models import llama
    from tests.llm.test_engine import random_prompts

    engine = make_engine(k_files["Q4_K_M"], num_kv_blocks=128, enable_prefix_caching=False)
    model = engine.runner.model
    assert model.fuse_rows > 256
    prompts = random_prompts([60] * 6, seed=9)  # 360 prompt rows in one step
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    rows = record_decode_rows(monkeypatch)
    fused = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert rows[0] > 256  # the prompts' step, one call a layer
    monkeypatch.setattr(llama, "FUSED_CHUNK", 128)
    rows.clear()
    chunked = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert max(rows) == 128
    assert [o.logprobs for o in chunked] == [o.logprobs for o in fused]  # rows independent
    monkeypatch.setattr(model, "fuse_rows", 0)  # the torch path
    rows.clear()
    torch_path = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert not rows
    exact = make_engine(k_files["Q4_K_M"], num_kv_blocks=128, gguf_activations="fp32")
    llm.engine = exact
    fp32_x = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in fused] == [o.token_ids for o in torch_path]

    def gaps(one: list, other: list) -> list[float]:
        return sorted(
            abs(a[t] - b[t])
            for f, g in zip(one, other, strict=True)
            for a, b in zip(f.logprobs, g.logprobs, strict=True)
            for t in a.keys() & b.keys()
        )

    near, rounding = gaps(fused, torch_path), gaps(torch_path, fp32_x)
    assert len(near) >= 5 * len(prompts) - 2
    assert near[len(near) // 2] < rounding[len(rounding) // 2]  # mostly the same bits
    assert near[-1] < 2 * rounding[-1]  # a flipped code costs what x's rounding costs


def test_gguf_activations_is_checked_naming_the_field(llama_dir):
    with pytest.raises(ValueError, match="gguf_activations must be 'int8' or 'fp32', got 'int4'"):
        make_engine(llama_dir, num_kv_blocks=8, gguf_activations="int4")
    with pytest.raises(ValueError, match="gguf_activations must be str, got 8"):
        make_engine(llama_dir, num_kv_blocks=8, gguf_activations=8)


@needs_quantize
def test_a_tied_head_reads_the_quantized_embedding(tmp_path):
    """A tied head (no output.weight): llama.cpp reads token_embd (Q4_K here) as the
    output matrix, and so does bitserve, while the embedding itself is dequantized once."""
    folder = build_model(tmp_path / "hf", k_config(tie_word_embeddings=True), seed=4)
    f32 = convert(folder, "f32", tmp_path / "f32.gguf")
    file = quantize(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    engine = make_engine(file, num_kv_blocks=64, gguf_activations="fp32")
    head = engine.runner.model.lm_head
    assert isinstance(head, GgmlLinear) and head.types != ["F32"]
    hf = llama_cpp_reference(file)
    prompt = MIXED[1]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=LONG, do_sample=False)
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    assert generate(engine, [prompt], params)[0] == want[0, len(prompt) :].tolist()


FAMILIES = {  # random models of each family, K-quant-sized rows
    "gemma2": ("Gemma2Config", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=16)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
}


def family_folder(folder: Path, family: str) -> Path:
    import transformers

    name, extra = FAMILIES[family]
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, **extra)
    config = getattr(transformers, name)(**shape, **{**COMMON, "initializer_range": 0.05})
    build_model(folder, config, seed=5)
    if family == "phi3":  # the converter reads a Phi-3 vocab by this class (or sentencepiece)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        settings["tokenizer_class"] = "GPT2Tokenizer"
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


@needs_quantize
@pytest.mark.parametrize(  # ~20 s each: Gemma 3 (qk-norm, sandwich norms, two RoPEs) always
    "family", [pytest.param(f, marks=[] if f == "gemma3" else pytest.mark.slow) for f in FAMILIES]
)
def test_gemma_and_phi3_files(family, tmp_path):
    """F32: the HF folder's own greedy tokens (Gemma's norms stored as 1 + w, its soft-caps
    and attention scale from the metadata; Phi-3's fused qkv and gate/up); Q4_K_M:
    llama.cpp's dequantized model (transformers, given the attention scale llama.cpp uses)."""
    folder = family_folder(tmp_path / "hf", family)
    f32 = convert(folder, "f32", tmp_path / "f32.gguf")
    prompt = MIXED[2]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert generate(make_engine(f32, num_kv_blocks=64), [prompt], params) == [
        reference(folder, prompt)
    ]
    file = quantize(f32, tmp_path / "q4_k_m.gguf", "Q4_K_M")
    engine = make_engine(file, num_kv_blocks=64, gguf_activations="fp32")
    assert block_types(engine.runner.model) == {"Q4_K", "Q6_K"}
    assert engine.runner.model.fuse_rows > 0
    scale = {"query_pre_attn_scalar": 64} if family.startswith("gemma") else {}
    hf = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32, **scale
    ).eval()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=LONG, do_sample=False)
        want_logits = hf(torch.tensor([prompt])).logits[0].float()
        got = window_logits(engine.runner.model, prompt)
    long = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    assert generate(engine, [prompt], long)[0] == want[0, len(prompt) :].tolist()
    assert float((got - want_logits).abs().max() / want_logits.abs().max()) < 1e-3


@needs_quantize
def test_an_unsupported_type_is_refused_naming_tensor_and_type(k_files, tmp_path):
    """Q2_K (or an IQ type) has no kernel: the load fails naming the tensor and type."""
    import gguf
    import numpy as np

    src = gguf.GGUFReader(str(k_files["f32"]))
    file = tmp_path / "q2_k.gguf"
    writer = gguf.GGUFWriter(str(file), src.get_field("general.architecture").contents())
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    q2k = gguf.GGMLQuantizationType.Q2_K
    for t in src.tensors:
        data = np.array(t.data)
        if t.name == "blk.1.ffn_down.weight":  # [256, 512]: 2 super-blocks a row
            size = gguf.GGML_QUANT_SIZES[q2k][1] * data.shape[1] // 256
            data = np.random.default_rng(0).integers(0, 256, (data.shape[0], size), np.uint8)
            writer.add_tensor(t.name, data, raw_dtype=q2k)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight: type Q2_K"):
        make_engine(file, num_kv_blocks=8)


@needs_converter
def test_bitserve_serve_takes_a_bare_gguf_file(llama_f32, monkeypatch):
    """`bitserve serve FILE.gguf`, nothing else: one llm model named after the file,
    answering completions (the app as `serve` builds it, in process, without uvicorn)."""
    from click.testing import CliRunner
    from starlette.testclient import TestClient

    from bitserve import cli

    apps = []
    monkeypatch.setattr(cli, "_run", lambda app, *args: apps.append(app))
    answer = CliRunner().invoke(cli.main, ["serve", str(llama_f32), "--threads", "1"])
    assert answer.exit_code == 0, answer.output
    with TestClient(apps[0]) as client:
        deadline = time.monotonic() + 60  # the model loads in the background
        while client.get("/v2/health/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/v2/health/ready").text
            time.sleep(0.1)
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["llama-f32"]
        body = {"model": "llama-f32", "prompt": "the quick brown", "max_tokens": 8}
        done = client.post("/v1/completions", json=body | {"temperature": 0})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 8


@needs_converter
def test_bitserve_eval_compares_a_gguf_with_its_folder(llama_dir, llama_f32, tmp_path):
    from click.testing import CliRunner

    from bitserve.cli import main

    file = llama_f32
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    args = ["eval", str(file), "--against", str(llama_dir), "--text", str(text), "--json"]
    args += ["--new-tokens", "4"]
    answer = CliRunner().invoke(main, args, catch_exceptions=False)
    result = json.loads(answer.output.strip().splitlines()[-1])
    assert result["comparison"]["perplexity_change"] == pytest.approx(0, abs=1e-4)
    assert result["comparison"]["next_token_agreement"] == 1.0


def test_llama_cpp_names_and_rope_permutation():
    """The mapping the loader applies, checked against llama.cpp's own permute."""
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    w = torch.randn(4 * 8, 5)  # 4 heads of 8
    permuted = w.reshape(4, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)  # LlamaModel.permute
    assert torch.equal(unpermute(permuted, 4), w)
