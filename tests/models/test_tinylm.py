"""models/tinylm: the committed language model loads, has the card's perplexity, writes English.

The held-out perplexity is recomputed here independently of tools/train_lm.py, following
the model card's description word for word.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
MODEL = Path(__file__).resolve().parents[2] / "models/tinylm"
PROMPTS = [
    "And the LORD spake unto Moses, saying,",
    "Now when Jesus was come into the house,",
    "My son, hear the instruction of thy father,",
]


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((MODEL / "metrics.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL / "1")


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL / "1", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def windows(tokenizer, model) -> torch.Tensor:
    """heldout.txt, whole, tokenized without special tokens, in consecutive windows."""
    size = model.config.max_position_embeddings
    ids = tokenizer((MODEL / "heldout.txt").read_text(), add_special_tokens=False)["input_ids"]
    n = len(ids) // size  # the last partial window is dropped
    return torch.tensor(ids[: n * size]).view(n, size)


@pytest.fixture(scope="module")
def words() -> set[str]:
    return set((MODEL / "words.txt").read_text().split())


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp(mean NLL of tokens 2..window given those before), one pass per window."""
    nll, count = 0.0, 0
    for window in windows.split(16):
        logits = model(input_ids=window).logits.float()
        nll += F.cross_entropy(
            logits[:, :-1].flatten(0, 1), window[:, 1:].flatten(), reduction="sum"
        ).item()
        count += window[:, 1:].numel()
    return math.exp(nll / count)


def english_share(text: str, words: set[str]) -> tuple[float, int]:
    found = re.findall(r"[a-z]+", text.lower())
    return sum(w in words for w in found) / max(1, len(found)), len(found)


def test_folder_is_complete_small_and_served_by_llm(model) -> None:
    folder = MODEL / "1"
    for name in ["config.json", "model.safetensors", "generation_config.json"]:
        assert (folder / name).is_file(), name
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 60e6
    config = tomllib.loads((MODEL / "config.toml").read_text())
    assert config["backend"] == "llm"
    assert config["parameters"]["max_model_len"] == model.config.max_position_embeddings
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert 5e6 <= model.num_parameters() <= 15e6


def test_heldout_perplexity_is_the_cards(model, windows, metrics) -> None:
    assert windows.shape[0] == metrics["heldout_windows"]
    measured = perplexity(model, windows)
    assert measured == pytest.approx(metrics["heldout_perplexity"], rel=0.01)
    card = (MODEL / "README.md").read_text()
    stated = float(re.search(r"## Held-out perplexity\s+\*\*([\d.]+)\*\*", card).group(1))
    assert stated == pytest.approx(measured, rel=0.01)


def test_far_below_a_random_model(model, windows) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    random_model = LlamaForCausalLM(model.config).eval()
    subset = windows[:16]
    trained, random = perplexity(model, subset), perplexity(random_model, subset)
    assert trained < random / 5, (trained, random)
    assert random > 0.5 * model.config.vocab_size  # near-uniform, as random weights are


def test_greedy_text_is_english_looking(model, tokenizer, words) -> None:
    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        text = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        share, count = english_share(text, words)
        assert count >= 15 and share >= 0.8, (prompt, text)


def test_chat_request_gets_text(model, tokenizer, words) -> None:
    messages = [{"role": "user", "content": "Blessed are the poor in spirit."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    reply = output[0, inputs["input_ids"].shape[1] :].tolist()
    special = set(tokenizer.all_special_ids) - {tokenizer.eos_token_id}
    assert not special & set(reply), tokenizer.decode(reply)
    share, count = english_share(tokenizer.decode(reply, skip_special_tokens=True), words)
    assert count >= 5 and share >= 0.8
