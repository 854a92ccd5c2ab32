"""LoRA adapters on a real `bitserve serve`: the `openai` client names an adapter as its
`model`, v2 generate as its `lora` parameter; vLLM's load/unload routes behind the admin
token. References are transformers + peft on the same PEFT folders."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import Server
from tests.server.test_openai import build_llm

torch.set_num_threads(1)
TOKEN = "lora-secret"
PROMPT = [1, 5, 9, 33, 70, 100, 7]
NEW = 6
CONFIG = """
backend = "llm"
[parameters]
max_model_len = 256
num_kv_blocks = 64
max_loras = 2
lora_modules = {{ a = "{a}" }}
"""


def make_adapter(base, folder, seed, rank=8):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_llm(root / "models" / "base" / "1")
    adapters = {
        name: make_adapter(base, root / name, seed)
        for seed, name in enumerate(["a", "b", "c"], start=1)
    }
    adapters["big"] = make_adapter(base, root / "big", 9, rank=32)  # past max_lora_rank 16
    (root / "models" / "base" / "config.toml").write_text(CONFIG.format(a=adapters["a"]))
    # a model whose version 1 is the base and version 2 adapter a over it (a rollout's pair)
    (root / "models" / "tuned" / "1").mkdir(parents=True)
    shutil.copytree(adapters["a"], root / "models" / "tuned" / "2")
    (root / "models" / "tuned" / "config.toml").write_text(
        f'backend = "llm"\n[parameters]\npath = "{base}"\nmax_model_len = 256\n'
        "num_kv_blocks = 32\n[version_policy]\nall = true\n"
    )
    server = Server(
        root / "models", "--admin-token", TOKEN, "--model-control", "explicit", "--load-model=*"
    )
    yield server, base, adapters
    server.stop()


def reference(base, adapter) -> tuple[list[str], list[float]]:
    """transformers + peft's greedy tokens for PROMPT (each decoded alone, as the API's
    logprobs show them) and their log-probabilities."""
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        logits = model(out).logits[0, len(PROMPT) - 1 : -1]
    tokens = out[0, len(PROMPT) :]
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0].tolist()
    tokenizer = AutoTokenizer.from_pretrained(base)
    return [tokenizer.decode([t]) for t in tokens], logprobs


def complete(server, model: str, prompt=PROMPT) -> tuple[list[str], list[float]]:
    """bitserve's greedy tokens and logprobs, through the `openai` client."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    answer = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=NEW,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.model == model
    logprobs = answer.choices[0].logprobs
    return logprobs.tokens, logprobs.token_logprobs


def assert_same(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def admin(server, path: str, body: dict, token: str = TOKEN) -> httpx.Response:
    """An admin call; a load names the base model (two models here serve LoRA)."""
    if path == "load_lora_adapter":
        body = {"model": "base", **body}
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.post(f"{server.url}/v1/{path}", json=body, headers=headers, timeout=60)


def test_a_configured_adapter_is_listed_with_its_parent_and_serves_its_own_model(setup):
    server, base, adapters = setup
    cards = {
        card.id: card
        for card in openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    }
    assert cards["a"].model_extra["parent"] == "base"
    assert_same(complete(server, "a"), reference(base, adapters["a"]))
    assert_same(complete(server, "base"), reference(base, None))


def test_load_use_unload_then_404_and_the_base_is_unaffected(setup):
    server, base, adapters = setup
    body = {"lora_name": "b", "lora_path": adapters["b"]}
    assert admin(server, "load_lora_adapter", body, token="wrong").status_code == 401
    assert admin(server, "load_lora_adapter", body).status_code == 200
    assert_same(complete(server, "b"), reference(base, adapters["b"]))
    assert admin(server, "unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(server, "b")
    assert admin(server, "unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    v2 = httpx.post(
        f"{server.url}/v2/models/base/generate",
        json={"text_input": "hello", "parameters": {"lora": "b"}},
    )
    assert v2.status_code == 400 and "lora" in v2.json()["error"]
    assert_same(complete(server, "base"), reference(base, None))


def test_v2_generate_selects_the_adapter_by_its_lora_parameter(setup):
    """The same text as the OpenAI API's for the adapter (checked against peft above)."""
    server, _, _ = setup
    text = "the quick brown fox"
    params = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    got = {}
    for lora in ("a", None):
        parameters = params | ({"lora": lora} if lora else {})
        answer = httpx.post(
            f"{server.url}/v2/models/base/generate",
            json={"text_input": text, "parameters": parameters},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        got[lora] = answer.json()["text_output"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for lora, output in got.items():
        want = client.completions.create(
            model=lora or "base",
            prompt=text,
            max_tokens=NEW,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert output == want.choices[0].text
    assert got["a"] != got[None]


def test_an_adapter_folder_as_a_model_version_serves_that_adapter(setup):
    """tuned/2 holds adapter a's files: pinned, it answers as the base with a does (the
    OpenAI API's model "a"), tuned/1 as the base: the rollout can canary the pair."""
    server, _, _ = setup
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for version, model in (("2", "a"), ("1", "base")):
        answer = httpx.post(
            f"{server.url}/v2/models/tuned/versions/{version}/generate",
            json={"text_input": "the lazy dog", "parameters": {"max_tokens": NEW,
                  "temperature": 0, "ignore_eos": True}},
            timeout=60,
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        want = client.completions.create(
            model=model, prompt="the lazy dog", max_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.json()["text_output"] == want.choices[0].text, version


def test_more_adapters_than_max_loras_are_evicted_and_reloaded_and_counted(setup):
    server, base, adapters = setup
    for name in ("b", "c"):
        body = {"lora_name": name, "lora_path": adapters[name]}
        assert admin(server, "load_lora_adapter", body).status_code == 200
    for name in ("a", "b", "c", "a"):  # two slots: c evicts a, a evicts b
        assert_same(complete(server, name), reference(base, adapters[name]))
    metrics = httpx.get(server.url + "/metrics").text
    samples = {
        (s.name, s.labels.get("adapter")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if "lora" in s.name
    }
    assert samples[("bitserve_llm_lora_requests_total", "c")] == 1
    assert samples[("bitserve_llm_lora_resident", "a")] == 1
    assert samples[("bitserve_llm_lora_resident", "b")] == 0
    for name in ("b", "c"):
        assert admin(server, "unload_lora_adapter", {"lora_name": name}).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_path": "/nowhere"}, "lora_name"),
        ({"lora_name": "x", "lora_path": "/nowhere"}, "lora_path"),
        ({"lora_name": "base", "lora_path": "/nowhere"}, "lora_name"),
        ({"lora_name": "x", "lora_path": "big"}, "max_lora_rank"),
        ({"lora_name": "a", "lora_path": "a"}, "already loaded"),
        ({"lora_name": "x", "lora_path": "a", "model": "nope"}, "model"),
    ],
)
def test_bad_loads_are_a_400_naming_the_field(setup, body, field):
    server, _, adapters = setup
    body = {k: adapters.get(v, v) if k == "lora_path" else v for k, v in body.items()}
    answer = admin(server, "load_lora_adapter", body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]
    assert complete(server, "a")  # the server goes on
