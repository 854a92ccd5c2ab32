"""GGUF files written by llama.cpp's own converter, served by the engine.

The converter (`convert_hf_to_gguf.py`) is llama.cpp's, installed by
tools/fetch_gguf_converter.py (make runs it); without it these tests skip. It runs
unchanged on the weights; two of its checks are told about our offline tokenizers,
which it has never seen: its table of known BPE pre-tokenizers (ours split as GPT-2
does, "gpt-2"), and its SentencePiece attempt, which imports sentencepiece before it
looks for a tokenizer.model we do not have (it then falls back to tokenizer.json, as
it does without that import).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitserve.llm.gguf import hf_name, quant_method, unpermute
from bitserve.quantize.evaluate import evaluate_llm
from tests.llm.conftest import make_engine
from tests.llm.test_engine import MIXED, generate, reference
from tests.quant.conftest import HELDOUT, TINYLM

CONVERTER = (
    Path(os.environ.get("BITSERVE_LLAMA_CPP", Path.home() / ".cache/bitserve/llama.cpp"))
    / "convert_hf_to_gguf.py"
)
RUN_CONVERTER = """
import runpy, sys
from pathlib import Path
conv = Path(sys.argv[1])
sys.path.insert(0, str(conv.parent))
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece = base.TextModel._set_vocab_sentencepiece
def set_vocab_sentencepiece(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
sys.argv = sys.argv[1:]
runpy.run_path(str(conv), run_name="__main__")
"""

needs_converter = pytest.mark.skipif(
    not CONVERTER.is_file(),
    reason=f"llama.cpp's converter is not at {CONVERTER}: run tools/fetch_gguf_converter.py",
)


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BITSERVE_GGUF_CACHE", str(tmp_path / "gguf-cache"))


def convert(folder: Path, outtype: str, out: Path) -> Path:
    args = [str(CONVERTER), str(folder), "--outtype", outtype, "--outfile", str(out)]
    subprocess.run([sys.executable, "-c", RUN_CONVERTER, *args], check=True, capture_output=True)
    return out


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
def test_q8_0_gguf_keeps_tinylm_perplexity_within_the_int8_limit(tmp_path):
    """Q8_0 is re-quantized as bitserve int8: llama.cpp's rounding, then bitserve's."""
    file = convert(TINYLM / "1", "q8_0", tmp_path / "tinylm-q8_0.gguf")
    result = evaluate_llm(file, TINYLM / "1", HELDOUT.read_text(), 256, 256, 2)
    change = result["comparison"]["perplexity_change"]
    print(f"tinylm Q8_0 GGUF as bitserve int8: perplexity change {change:+.4%}")
    assert abs(change) < 0.01  # the int8 limit (tests/quant/test_tinylm.py)
    assert result["comparison"]["next_token_agreement"] > 0.95


def requantize(src: Path, dst: Path, kind: str) -> Path:
    """`src` with its F32 decoder matrices quantized to `kind` by gguf-py (ggml's
    reference quantizer, what llama-quantize applies; the converter cannot write Q4_0).
    A matrix whose rows are not whole blocks of 32 stays F32 (llama-quantize would
    pick a fallback type for it)."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.get_field("general.architecture").contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data)
        blocks = data.ndim == 2 and data.shape[-1] % 32 == 0
        if t.name.startswith("blk.") and blocks and t.tensor_type.name == "F32":
            writer.add_tensor(t.name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@needs_converter
@pytest.mark.slow
def test_q4_0_gguf_keeps_tinylm_perplexity_within_the_int4_limit(tmp_path):
    """Q4_0 is re-quantized as bitserve int4 (group 32): llama.cpp's rounding, then ours."""
    f32 = convert(TINYLM / "1", "f32", tmp_path / "tinylm-f32.gguf")
    file = requantize(f32, tmp_path / "tinylm-q4_0.gguf", "Q4_0")
    result = evaluate_llm(file, TINYLM / "1", HELDOUT.read_text(), 256, 1024, 2)
    change = result["comparison"]["perplexity_change"]
    print(f"tinylm Q4_0 GGUF as bitserve int4: perplexity change {change:+.4%}")
    assert abs(change) < 0.05  # the int4 limit (tests/quant/test_tinylm.py)


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


def test_only_q8_0_and_q4_0_map_onto_bitserve_methods():
    class Tensor:
        def __init__(self, name, kind):
            self.name = name
            self.tensor_type = type("T", (), {"name": kind})

    def reader(*kinds):
        return type("R", (), {"tensors": [Tensor(f"blk.{i}.x", k) for i, k in enumerate(kinds)]})

    assert quant_method(reader("F32", "F16")) is None
    assert quant_method(reader("Q8_0", "F32")) == "int8"
    assert quant_method(reader("Q4_0")) == "int4"
    with pytest.raises(ValueError, match="mixes"):
        quant_method(reader("Q8_0", "Q4_0"))
