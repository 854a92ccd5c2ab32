"""`isolation = "process"` on an llm model (repository/llmprocess.py): the engine in a
child process, the front door in the server. One server holds the same tiny random
llama twice, in-process ("local") and in an engine process ("proc"): greedy answers are
the same through every protocol, a closed stream frees its KV blocks in the child, a
child killed with SIGKILL is a lost replica (503 + Retry-After, then a replacement
serves), and a server killed with SIGKILL leaves no engine process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import tomllib

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bitserve.backends.llm import LLMService
from bitserve.config import ModelConfig
from bitserve.llm.sampling_params import SamplingParams
from bitserve.repository.llmprocess import ProcessLLMService
from tests.conftest import Server
from tests.server.test_openai import build_llm

CONFIG = """
backend = "llm"
[instance_group]
isolation = "{isolation}"
[parameters]
max_model_len = 256
num_kv_blocks = 64
system_prompt = "You are terse."
"""

PROMPTS = ["the quick brown fox", "a paged kv cache", "héllo"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_process") / "models"
    build_llm(root / "local" / "1")
    (root / "local" / "config.toml").write_text(CONFIG.format(isolation="thread"))
    build_llm(root / "proc" / "1")
    (root / "proc" / "config.toml").write_text(CONFIG.format(isolation="process"))
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo)
    yield s
    s.stop()


def engines(server) -> list[psutil.Process]:
    """The server's engine processes (multiprocessing names them in argv)."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def metric(server, name, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def chat(url: str, model: str, prompt: str, stream: bool = False) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    return text


def generate(url: str, model: str, prompt: str) -> str:
    doc = {"text_input": prompt, "parameters": {"max_tokens": 8, "temperature": 0}}
    answer = httpx.post(f"{url}/v2/models/{model}/generate", json=doc, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["text_output"]


def test_the_engine_runs_in_one_child_process(server):
    assert len(engines(server)) == 1
    assert "ray" not in " ".join(" ".join(c.cmdline()) for c in engines(server))


def test_greedy_answers_equal_the_in_process_engine(server):
    for prompt in PROMPTS:
        local = chat(server.url, "local", prompt)
        assert len(local) > 0
        assert chat(server.url, "proc", prompt) == local
        assert chat(server.url, "proc", prompt, stream=True) == local
        assert generate(server.url, "proc", prompt) == generate(server.url, "local", prompt)


def test_a_closed_stream_aborts_in_the_child_and_frees_its_kv(repo):
    """The engine's own counters (the child's, through the health pings): a request
    for 6,000 tokens closed after 4 outputs stops far short of them and its KV blocks
    are free. The budget is the margin: the tiny engine makes ~1,800 tokens a second, so
    the abort has seconds to arrive (240 tokens were once all made before it did, on a
    loaded box); the engine only warns that 8,192 exceeds the model's 512 positions."""
    doc = tomllib.loads((repo / "proc" / "config.toml").read_text())
    doc["parameters"].update(max_model_len=8192, num_kv_blocks=600)
    config = ModelConfig.model_validate({**doc, "name": "proc"})

    async def run() -> dict:
        service = ProcessLLMService(config, repo / "proc" / "1")
        await service.start()
        try:
            params = SamplingParams(max_tokens=6000, temperature=0, ignore_eos=True)
            request = service._reserve(service.tokenizer.encode("the quick"), params)
            outputs = 0
            generation = service.generate(request)
            async with contextlib.aclosing(generation):
                async for _ in generation:
                    outputs += 1
                    if outputs == 4:
                        break
            await asyncio.sleep(3.5)  # pings each second; each brings the last read
            return service.metrics()
        finally:
            await service.stop()

    engine = asyncio.run(run())
    assert 4 <= engine["generation_tokens_total"] < 3000, engine["generation_tokens_total"]
    assert engine["num_requests_running"] == 0
    assert engine["kv_cache_usage"] == 0


def test_a_killed_engine_process_is_a_503_then_a_replacement_serves(server):
    reference = chat(server.url, "local", PROMPTS[0])
    (child,) = engines(server)
    body = {"model": "proc", "prompt": "the quick", "max_tokens": 240, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 2:
                    os.kill(child.pid, signal.SIGKILL)
    assert any("lost mid-request" in e and "service_unavailable" in e for e in events), events[-3:]
    answer = httpx.post(
        server.url + "/v1/completions",
        json={"model": "proc", "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 60
    while True:  # the watchdog starts a replacement within a second; it loads and warms
        try:
            assert chat(server.url, "proc", PROMPTS[0]) == reference
            break
        except AssertionError:
            assert time.monotonic() < deadline, "no replacement engine process"
            time.sleep(0.3)
    (replacement,) = engines(server)
    assert replacement.pid != child.pid
    assert metric(server, "bitserve_llm_replicas_replaced_total", model="proc") == 1


def test_a_killed_server_leaves_no_engine_process(repo):
    s = Server(repo)
    try:
        (child,) = engines(s)
        s.process.kill()
        s.process.wait()
        child.wait(10)  # raises psutil.TimeoutExpired if it outlived the server
        assert not child.is_running()
    finally:
        s.stop()


def test_two_engine_processes_share_the_requests_and_answer_as_one(repo):
    """count = 2: two engine processes behind the prefix router; concurrent greedy
    requests are spread over both, and each answer is the in-process engine's."""
    local = ModelConfig.model_validate(
        {**tomllib.loads((repo / "local" / "config.toml").read_text()), "name": "local"}
    )
    doc = tomllib.loads((repo / "proc" / "config.toml").read_text())
    doc["instance_group"]["count"] = 2
    config = ModelConfig.model_validate({**doc, "name": "proc"})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def texts(service, prompts: list[str]) -> list[str]:
        async def one(prompt: str) -> str:
            request = service._reserve(service.tokenizer.encode(prompt), params)
            async for out in service.generate(request):
                text = out.outputs[0].text
            return text

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def run() -> tuple[list[str], list[str], list[int]]:
        reference = LLMService(local, repo / "local" / "1")
        await reference.start()
        try:
            expected = await texts(reference, PROMPTS * 2)
        finally:
            await reference.stop()
        service = ProcessLLMService(config, repo / "proc" / "1")
        await service.start()
        try:
            got = await texts(service, PROMPTS * 2)
            return expected, got, [r.served for r in service.replicas]
        finally:
            await service.stop()

    expected, got, served = asyncio.run(run())
    assert got == expected
    assert sum(served) == 6 and min(served) >= 1, served


def test_config_names_the_field_on_bad_values():
    llm = {"name": "m", "backend": "llm"}
    assert (
        ModelConfig.model_validate(
            {**llm, "instance_group": {"isolation": "process"}}
        ).instance_group.isolation
        == "process"
    )
    with pytest.raises(ValueError, match=r"instance_group\.isolation"):
        ModelConfig.model_validate({**llm, "instance_group": {"isolation": "processes"}})
    with pytest.raises(ValueError, match='num_cpus: Ray resources, only with isolation = "ray"'):
        ModelConfig.model_validate(
            {**llm, "instance_group": {"isolation": "process", "num_cpus": 1}}
        )
