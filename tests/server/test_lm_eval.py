"""lm-eval as the real client of bitserve's prompt scoring (issue 32, item 2): a
multiple-choice task from a local file, run with lm-eval's own `hf` model on the default
LLM and with its `local-completions` model against `bitserve serve` of the same weights.
local-completions sends exactly what loglikelihood tasks need from a server: the
context and continuation tokens as the prompt, `echo: true`, `logprobs: 1`, a
`max_tokens` of 1 it then drops; both runs must give the same accuracy and the same
per-sample loglikelihoods."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import ROOT, Server

lm_eval = pytest.importorskip("lm_eval", reason="pip install lm-eval (the test extra)")

TINYLM = ROOT / "models" / "tinylm" / "1"
QUESTIONS = [  # (question, choices, answer): Bible-flavoured, as tinylm was trained
    ("In the beginning God created the", ["heaven", "ocean", "engine"], 0),
    ("And God said, Let there be", ["light", "cars", "numbers"], 0),
    ("The Lord is my", ["shepherd", "keyboard", "window"], 0),
    ("Thou shalt not", ["kill", "compile", "swim"], 0),
    ("Blessed are the", ["meek", "routers", "clouds"], 0),
    ("Our Father which art in", ["heaven", "Paris", "debt"], 0),
    ("And the earth was without form, and", ["void", "wifi", "rice"], 0),
    ("For God so loved the", ["world", "printer", "moon"], 0),
]
TASK = """task: bitserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-task")
    data = folder / "data.jsonl"
    lines = [json.dumps({"question": q, "choices": c, "answer": a}) for q, c, a in QUESTIONS]
    data.write_text("\n".join(lines) + "\n")
    (folder / "bitserve_mc.yaml").write_text(TASK.format(data=data))
    return folder


def evaluate(tasks, model: str, model_args: str) -> tuple[float, list]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["bitserve_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        log_samples=True,
    )
    samples = sorted(out["samples"]["bitserve_mc"], key=lambda s: s["doc_id"])
    scores = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return out["results"]["bitserve_mc"]["acc,none"], scores


def test_local_completions_against_bitserve_equals_lm_evals_hf_model(tasks, tmp_path):
    acc_hf, hf = evaluate(tasks, "hf", f"pretrained={TINYLM},dtype=float32,device=cpu")
    repo = tmp_path / "models"
    shutil.copytree(ROOT / "models" / "tinylm", repo / "tinylm")
    server = Server(repo)
    try:
        args = f"model=tinylm,base_url={server.url}/v1/completions,tokenizer={TINYLM}"
        # lm-eval's API models leave BOS out unless asked; its hf model adds it (the
        # tokenizer's default): the same tokens on both sides
        args += ",tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1"
        acc_served, served = evaluate(tasks, "local-completions", args)
    finally:
        server.stop()
    assert acc_served == acc_hf
    assert len(served) == len(hf) == len(QUESTIONS)
    for mine, theirs in zip(served, hf, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-4)
    assert acc_hf > 1 / 3  # tinylm knows its Bible: the check is not a coin toss
