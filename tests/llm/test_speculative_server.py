"""Speculative decoding on a real server: the model's `speculative` table, the OpenAI
client's per-request opt-out, a bad value's 400, and the Prometheus counters."""

from __future__ import annotations

import httpx
import openai
import pytest

from bitserve.llm import LLM, SamplingParams
from bitserve.loadtest import report, server_view
from tests.conftest import Server
from tests.server.test_openai import build_llm, metric

CONFIG = """
backend = "llm"
[parameters]
max_model_len = 256
num_kv_blocks = 64
speculative = { method = "ngram", num_tokens = 3, ngram_min = 1 }
"""
PROMPT = "the quick brown fox jumps over the lazy dog the quick brown"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec") / "models"
    build_llm(root / "spec" / "1")
    (root / "spec" / "config.toml").write_text(CONFIG)
    s = Server(root)
    s.folder = root / "spec" / "1"
    yield s
    s.stop()


def test_speculative_answers_are_the_plain_engines_and_counted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    llm = LLM(server.folder, num_kv_blocks=64)  # no speculation
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    drafts = metric(server, "bitserve_llm_spec_decode_num_draft_tokens_total", model="spec")
    for opt_out in (False, True):
        extra = {"ignore_eos": True} | ({"speculative": False} if opt_out else {})
        answer = client.completions.create(
            model="spec", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra
        )
        assert answer.choices[0].text == want[0].outputs[0].text
        now = metric(server, "bitserve_llm_spec_decode_num_draft_tokens_total", model="spec")
        assert now == drafts if opt_out else now > drafts
        drafts = now
    accepted = metric(server, "bitserve_llm_spec_decode_num_accepted_tokens_total", model="spec")
    by_position = metric(
        server, "bitserve_llm_spec_decode_num_accepted_tokens_per_pos_total", model="spec"
    )
    assert accepted == by_position
    emitted = metric(server, "bitserve_llm_spec_decode_num_emitted_tokens_total", model="spec")
    assert emitted >= accepted


def test_a_bad_opt_out_is_a_400_naming_the_field(server):
    body = {"model": "spec", "prompt": "x", "max_tokens": 2, "speculative": "no"}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 400
    assert "speculative" in response.text
    ok = httpx.post(server.url + "/v1/completions", json={**body, "speculative": False})
    assert ok.status_code == 200


def test_the_bench_report_shows_the_acceptance(server):
    before = server_view.scrape(server.url, "spec")
    body = {"model": "spec", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    view = server_view.difference(before, server_view.scrape(server.url, "spec"))
    rates = [float(r) for r in view["spec_acceptance_by_position"].split("/")]
    # the positions this request reached (num_tokens 3; a match of n proposes n + 1 at
    # most, and this random model's answer repeats little)
    assert 1 <= len(rates) <= 3 and all(0 <= r <= 1 for r in rates)
    assert 0 <= view["spec_acceptance"] <= 1
    text = report.table([{"load": "c=1", "completed": 1, "failed": 0, "server": view}])
    assert "spec accept" in text and view["spec_acceptance_by_position"] in text
