"""Tiny random-weight Hugging Face models built offline, and the pool-is-empty check.

Each model folder is built once per session (config -> `save_pretrained`) with a
byte-level BPE tokenizer trained on a few sentences, so nothing is downloaded.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from bitserve.llm.engine import LLMEngine  # noqa: E402

VOCAB = 384
BOS, EOS = 1, 2
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged kv cache keeps every block of every sequence",
    "héllo wörld ünïcode ☃ snowman 日本語 テキスト",
    "continuous batching lets requests join and leave at every step",
] * 20


def build_tokenizer(folder: Path) -> int:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return tok.get_vocab_size()


COMMON = dict(
    vocab_size=VOCAB,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=0,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def llama_config():
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **COMMON,
    )


def qwen2_config():
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **COMMON,
    )


def mixtral_config():
    return MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **COMMON,
    )


def gpt2_config():
    common = {k: v for k, v in COMMON.items() if k != "max_position_embeddings"}
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)


CONFIGS = {
    "llama": llama_config,
    "qwen2": qwen2_config,
    "mixtral": mixtral_config,
    "gpt2": gpt2_config,
}


def build_model(folder: Path, config, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder)
    assert vocab == VOCAB, vocab
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(root / name, make()) for name, make in CONFIGS.items()}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


_engines: list[LLMEngine] = []


@pytest.fixture(autouse=True)
def every_block_returns():
    """After every test, every engine built in it has its whole pool free again."""
    _engines.clear()
    yield
    for engine in _engines:
        bm = engine.block_manager
        assert not engine.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
        assert all(b.ref_count == 0 for b in bm.blocks)
    _engines.clear()
    gc.collect()


def make_engine(path: Path, **kwargs) -> LLMEngine:
    engine = LLMEngine(path, **kwargs)
    _engines.append(engine)
    return engine


def record_decode_rows(monkeypatch) -> list[int]:
    """The row count of every C decoder-layer call from now on (one entry a layer call),
    the call itself unchanged."""
    from bitserve import kernels

    rows: list[int] = []
    original = kernels.Kernels.decode_layer
    monkeypatch.setattr(
        kernels.Kernels,
        "decode_layer",
        lambda s, p, x, *a: rows.append(x.shape[0]) or original(s, p, x, *a),
    )
    return rows
