"""The OpenAI API on a real server, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from bitserve.llm import LLM, SamplingParams
from tests.conftest import ROOT, Server, write_model
from tests.llm.conftest import build_tokenizer, llama_config

torch.set_num_threads(1)

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_llm(folder, chat_template: bool = True):
    folder.mkdir(parents=True)
    build_tokenizer(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(folder)
    if chat_template:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


LLM_CONFIG = """
backend = "llm"
[parameters]
max_model_len = 256
num_kv_blocks = {blocks}
max_num_seqs = {seqs}
max_queued_requests = {queued}
system_prompt = "You are terse."
few_shot = [{{ role = "user", content = "hi" }}, {{ role = "assistant", content = "hello" }}]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai") / "models"
    build_llm(root / "chat" / "1")
    (root / "chat" / "config.toml").write_text(LLM_CONFIG.format(blocks=128, seqs=16, queued=64))
    shutil.copytree(root / "chat" / "1", root / "busy" / "1")
    (root / "busy" / "config.toml").write_text(LLM_CONFIG.format(blocks=64, seqs=1, queued=2))
    build_llm(root / "nochat" / "1", chat_template=False)
    (root / "nochat" / "config.toml").write_text('backend = "llm"\n')
    shutil.copytree(ROOT / "models" / "minilm", root / "minilm")
    write_model(
        root,
        "plain",
        """
        backend = "python"
        max_batch_size = 2
        [[input]]
        name = "x"
        datatype = "FP32"
        dims = [1]
        [[output]]
        name = "x"
        datatype = "FP32"
        dims = [1]
        """,
        "class Model:\n    def predict(self, inputs):\n        return inputs\n",
    )
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metric(server, name, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_models_lists_llms_and_embedders(client):
    models = {m.id: m for m in client.models.list().data}
    assert {"chat", "minilm", "nochat"} <= set(models) and "plain" not in models
    assert models["chat"].max_model_len == 256  # the context it serves (config.toml's)
    assert models["nochat"].max_model_len == 512  # max_position_embeddings


def test_completion_equals_offline_generate(client, repo):
    prompt = "the quick brown fox"
    got = client.completions.create(
        model="chat", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    offline = LLM(repo / "chat" / "1", num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0]
    assert got.choices[0].text == offline.outputs[0].text
    assert got.usage.completion_tokens == 24
    assert got.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert got.choices[0].finish_reason == "length"


def test_chat_streaming_with_usage_matches_non_streaming(client):
    messages = [{"role": "user", "content": "tell me about blocks"}]
    kwargs = dict(
        model="chat",
        messages=messages,
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [
        (t.token, round(t.logprob, 5)) for t in whole.choices[0].logprobs.content
    ]
    assert all(len(t.top_logprobs) == 2 for t in streamed)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    assert chunks[-1].choices == []


def test_n_and_seeded_sampling(client):
    kwargs = dict(model="chat", prompt="a paged kv", max_tokens=12, temperature=1.0, seed=7, n=3)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len(first.choices) == 3 and len({c.text for c in first.choices}) > 1
    assert sorted(c.index for c in first.choices) == [0, 1, 2]


def test_completion_logprobs_and_echo(client):
    got = client.completions.create(
        model="chat",
        prompt="the lazy",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = got.choices[0]
    prompt_tokens = got.usage.prompt_tokens
    assert choice.text.startswith("the lazy")
    assert len(choice.logprobs.tokens) == prompt_tokens + 5  # the echoed prompt is scored too
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    generated = zip(
        choice.logprobs.tokens[prompt_tokens:],
        choice.logprobs.token_logprobs[prompt_tokens:],
        choice.logprobs.top_logprobs[prompt_tokens:],
        strict=True,
    )
    for token, lp, top in generated:
        # greedy: the chosen token is the most likely one (distinct ids may share a text)
        assert lp <= 0 and token in top and max(top.values()) == pytest.approx(lp)
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


PROMPT_IDS = [5, 17, 42, 99, 7, 23, 64, 3]


@pytest.fixture(scope="module")
def reference(repo):
    """transformers' log-softmax of PROMPT_IDS through the chat model (fp32): row i-1
    scores token i."""
    model = AutoModelForCausalLM.from_pretrained(repo / "chat" / "1", dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers(client, repo, reference):
    """lm-eval's local-completions loglikelihood request: echo, logprobs, max_tokens 0."""
    got = client.completions.create(
        model="chat", prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice, logprobs = got.choices[0], got.choices[0].logprobs
    assert choice.finish_reason == "length" and got.usage.completion_tokens == 0
    assert len(logprobs.tokens) == len(PROMPT_IDS) and logprobs.token_logprobs[0] is None
    want = [reference[i - 1, t].item() for i, t in enumerate(PROMPT_IDS) if i]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(logprobs.top_logprobs[1:]):  # the prompt token and the top 1
        assert max(top.values()) == pytest.approx(reference[i].max().item(), abs=1e-4)
    assert choice.text == AutoTokenizer.from_pretrained(repo / "chat" / "1").decode(PROMPT_IDS)


def test_vllms_prompt_logprobs_on_completions_and_chat(server, reference):
    body = {"model": "chat", "prompt": PROMPT_IDS, "max_tokens": 2, "prompt_logprobs": 2}
    body |= {"temperature": 0, "ignore_eos": True}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    for i, (token, entry) in enumerate(zip(PROMPT_IDS[1:], entries[1:], strict=True)):
        assert entry[str(token)]["logprob"] == pytest.approx(reference[i, token].item(), abs=1e-4)
        top2 = reference[i].topk(2).indices.tolist()
        assert {str(t) for t in top2} <= set(entry) and len(entry) <= 3
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat | {"prompt_logprobs": 0})
    scored = answer.json()["prompt_logprobs"]
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])
    bad = httpx.post(server.url + "/v1/completions", json=body | {"prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_streamed_echo_sends_the_prompt_first(server):
    body = {"model": "chat", "prompt": "the lazy", "max_tokens": 0, "echo": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["the lazy", ""] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    plain = httpx.post(server.url + "/v1/completions", json=body | {"echo": False})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"


def test_embeddings_route_to_minilm(client):
    got = client.embeddings.create(model="minilm", input=["a cat", "a dog"])
    assert len(got.data) == 2 and len(got.data[0].embedding) == 384
    assert got.usage.prompt_tokens > 0


def test_async_client(server):
    async def go():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        answers = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="chat",
                    max_tokens=8,
                    temperature=0,
                    messages=[{"role": "user", "content": f"q{i}"}],
                )
                for i in range(4)
            ]
        )
        await aclient.close()
        return answers

    answers = asyncio.run(go())
    assert all(a.choices[0].message.role == "assistant" for a in answers)


def test_few_shot_prefix_and_opt_out(server):
    messages = [{"role": "user", "content": "x"}]
    with_shots = httpx.post(
        server.url + "/tokenize", json={"model": "chat", "messages": messages}
    ).json()
    body = {"model": "chat", "messages": messages, "max_tokens": 2, "few_shot": False}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
    text = httpx.post(
        server.url + "/detokenize", json={"model": "chat", "tokens": with_shots["tokens"]}
    ).json()
    assert "You are terse." in text["prompt"] and "user: hi" in text["prompt"]
    hits = metric(server, "bitserve_llm_prefix_cache_hits_total", model="chat")
    for _ in range(2):
        httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "chat", "messages": messages, "max_tokens": 2},
        )
    assert metric(server, "bitserve_llm_prefix_cache_hits_total", model="chat") > hits


def test_streaming_disconnect_aborts_and_frees_kv(server):
    body = {
        "model": "chat",
        "prompt": "the quick",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    before = metric(server, "bitserve_llm_generation_tokens_total", model="chat")
    deadline = time.monotonic() + 5
    while metric(server, "bitserve_llm_kv_cache_usage_perc", model="chat") != 0:
        assert time.monotonic() < deadline, "KV blocks were not returned"
        time.sleep(0.05)
    assert metric(server, "bitserve_llm_num_requests_running", model="chat") == 0
    assert (
        metric(server, "bitserve_llm_request_success_total", model="chat", finished_reason="abort")
        >= 1
    )
    assert metric(server, "bitserve_llm_generation_tokens_total", model="chat") - before < 10


def test_overload_gets_429_and_the_admitted_finish(server):
    body = {"model": "busy", "prompt": "the quick", "max_tokens": 30, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(
                lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=60),
                range(16),
            )
        )
    codes = [a.status_code for a in answers]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    rejected = next(a for a in answers if a.status_code == 429)
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert all(
        a.json()["usage"]["completion_tokens"] == 30 for a in answers if a.status_code == 200
    )
    assert httpx.get(server.url + "/v2/health/live").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "chat", "prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"model": "chat", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"model": "chat", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "chat", "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "chat", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        ("/v1/completions", {"model": "chat", "prompt": "fox " * 300}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "nochat", "messages": [{"role": "user", "content": "x"}]},
            400,
            None,
        ),
        ("/v1/completions", {"model": "plain", "prompt": "x"}, 400, "model"),
        ("/v1/embeddings", {"model": "chat", "input": "x"}, 400, "model"),
    ],
)
def test_bad_input_gets_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_prompt_too_long_names_both_lengths(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "chat", "prompt": "fox " * 300, "max_tokens": 10},
    )
    message = r.json()["error"]["message"]
    assert "256" in message and "prompt tokens" in message


def test_malformed_json(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_v2_generate_and_infer_on_the_same_model(server):
    doc = {
        "text_input": "the quick",
        "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    generated = httpx.post(server.url + "/v2/models/chat/generate", json=doc).json()
    infer = httpx.post(
        server.url + "/v2/models/chat/infer",
        json={
            "inputs": [
                {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["the quick"]},
                {
                    "name": "sampling_parameters",
                    "shape": [1],
                    "datatype": "BYTES",
                    "data": [json.dumps(doc["parameters"])],
                },
            ]
        },
    ).json()
    assert infer["outputs"][0]["data"][0] == generated["text_output"]
    with httpx.stream("POST", server.url + "/v2/models/chat/generate_stream", json=doc) as r:
        pieces = [
            json.loads(line[6:])["text_output"]
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]
    assert "".join(pieces) == generated["text_output"]


def test_llm_metrics_follow_vllm_definitions(server, client):
    before = metric(server, "bitserve_llm_time_to_first_token_seconds_count", model="chat")
    tpot_before = metric(server, "bitserve_llm_time_per_output_token_seconds_count", model="chat")
    client.completions.create(
        model="chat", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert metric(server, "bitserve_llm_time_to_first_token_seconds_count", model="chat") == (
        before + 1
    )
    assert (
        metric(server, "bitserve_llm_time_per_output_token_seconds_count", model="chat")
        == tpot_before + 1
    )
    assert metric(server, "bitserve_llm_request_queue_time_seconds_count", model="chat") > 0


def test_server_stays_live_through_all_of_it(server):
    threading.Event().wait(0.1)
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200


def test_non_streaming_disconnect_aborts(server):
    import socket

    body = json.dumps(
        {"model": "chat", "prompt": "the quick", "max_tokens": 240, "ignore_eos": True}
    ).encode()
    labels = {"model": "chat", "finished_reason": "abort"}
    aborted = metric(server, "bitserve_llm_request_success_total", **labels)
    generated = metric(server, "bitserve_llm_generation_tokens_total", model="chat")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
    deadline = time.monotonic() + 10
    while metric(server, "bitserve_llm_request_success_total", **labels) == aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert metric(server, "bitserve_llm_kv_cache_usage_perc", model="chat") == 0
    assert metric(server, "bitserve_llm_generation_tokens_total", model="chat") - generated < 240
