"""Against a server built to have known latencies, the tool reports those latencies."""

from __future__ import annotations

import pytest

from bitserve.loadtest import metrics, workloads
from bitserve.loadtest.loadgen import Load, run
from tests.loadtest.conftest import DELAY_MS, PREFILL_MS, TOKEN_MS

SLACK_MS = 40.0  # scheduling noise on a shared, busy 2-core machine; never below target


def test_v2_latency_is_the_servers_delay(slow_server):
    host = slow_server.removeprefix("http://")
    meta = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]}
    requests = workloads.v2_requests(host, "slow", meta, distinct=4)
    s = metrics.summarise(run(slow_server, requests, Load(concurrency=4, num_requests=40)))
    assert s["completed"] == 40
    assert DELAY_MS <= s["e2el"]["median_ms"] <= DELAY_MS + SLACK_MS
    # 4 users, each request DELAY_MS: at most 4 / DELAY_MS req/s
    assert 0.6 * 4000 / DELAY_MS <= s["request_throughput"] <= 4000 / DELAY_MS


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streaming_ttft_tpot_itl(slow_server, api):
    host = slow_server.removeprefix("http://")
    opts = workloads.OpenAIOptions(
        model="slow", api=api, lengths=workloads.Lengths(20, 8, "fixed"), ignore_eos=True
    )
    requests = workloads.openai_requests(host, opts, 16)
    s = metrics.summarise(run(slow_server, requests, Load(concurrency=4, num_requests=16)))
    assert s["completed"] == 16
    assert s["total_output_tokens"] == 16 * 8 and s["total_input_tokens"] == 16 * 20
    assert PREFILL_MS <= s["ttft"]["median_ms"] <= PREFILL_MS + SLACK_MS
    assert TOKEN_MS * 0.8 <= s["tpot"]["median_ms"] <= TOKEN_MS + SLACK_MS / 5
    assert TOKEN_MS * 0.8 <= s["itl"]["median_ms"] <= TOKEN_MS + SLACK_MS / 5
    e2e = PREFILL_MS + 7 * TOKEN_MS
    assert e2e <= s["e2el"]["median_ms"] <= e2e + 2 * SLACK_MS
