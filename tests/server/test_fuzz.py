"""Fuzz the published schema (`/openapi.json`) with schemathesis, for a bounded time.

Every operation gets schema-valid bodies (every field at its extremes) and invalid ones
(wrong types, missing fields, values outside the ranges). No answer may be a 5xx, the
LLM engine may not restart, and the server is live and ready afterwards.
"""

from __future__ import annotations

import shutil
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode

from tests.conftest import ROOT, Server

EXAMPLES = 40  # per operation and mode: ~800 requests, about a minute on 2 cores
BUDGET_S = 150.0  # examples past this are skipped, so the test stays bounded


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    from build_models import build

    repo = tmp_path_factory.mktemp("fuzz") / "models"
    for name in ("tinylm", "minilm", "mlp", "bow_classifier"):
        shutil.copytree(ROOT / "models" / name, repo / name)
    build(repo, names=["mlp", "bow_classifier"])
    server = Server(repo)
    yield server
    server.stop()


def _restarts(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("bitserve_llm_engine_restarts")
    )


def test_the_published_schema_survives_fuzzing(server):
    document = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    counts = {"requests": 0, "4xx": 0}
    failures: list[str] = []
    started = time.monotonic()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(server.url, operation, mode, counts, failures, started)
    print(f"\nfuzz: {counts['requests']} requests, {counts['4xx']} answered 4xx")
    assert not failures, "\n".join(failures[:10])
    assert counts["requests"] >= 300
    assert httpx.get(server.url + "/v2/health/live").status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    assert _restarts(server.url) == 0
    assert server.alive()


def _fuzz(url, operation, mode, counts, failures, started) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        if time.monotonic() - started > BUDGET_S:
            return
        response = case.call(base_url=url, timeout=60)
        counts["requests"] += 1
        counts["4xx"] += 400 <= response.status_code < 500
        if response.status_code >= 500:
            failures.append(
                f"{operation.label} ({mode.value}) -> {response.status_code} "
                f"{response.text[:300]}\n  body: {str(case.body)[:300]}"
            )

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
        assert mode is GenerationMode.NEGATIVE
