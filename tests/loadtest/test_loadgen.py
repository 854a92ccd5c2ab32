"""Open-loop arrivals follow the requested distribution (Kolmogorov-Smirnov, scipy);
closed loops keep their concurrency; every run is bounded."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from bitserve.loadtest.client import build_request
from bitserve.loadtest.loadgen import Load, arrival_times, intervals, run
from bitserve.loadtest.workloads import Request

ALPHA = 0.01


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_generated_intervals_pass_ks_against_gamma(burstiness):
    rate = 20.0
    gaps = intervals(rate, burstiness, 5000, np.random.default_rng(7))
    expected = stats.gamma(a=burstiness, scale=1 / (rate * burstiness))
    assert stats.kstest(gaps, expected.cdf).pvalue > ALPHA
    if burstiness == 1.0:  # Poisson process: exponential gaps of mean 1/rate
        assert stats.kstest(gaps, stats.expon(scale=1 / rate).cdf).pvalue > ALPHA
    other = stats.gamma(a=burstiness * 2, scale=1 / (rate * burstiness * 2))
    assert stats.kstest(gaps, other.cdf).pvalue < ALPHA  # the test can tell them apart


def test_arrivals_are_seeded_and_bounded_by_duration():
    a = arrival_times(Load(rate=50, duration=2.0, seed=3))
    b = arrival_times(Load(rate=50, duration=2.0, seed=3))
    assert np.array_equal(a, b) and a[-1] <= 2.0 and 60 < len(a) < 140
    assert len(arrival_times(Load(rate=float("inf"), num_requests=10))) == 10


def test_sent_requests_follow_the_schedule(slow_server):
    """The send times really measured on the wire pass KS against exponential gaps."""
    host = slow_server.removeprefix("http://")
    body = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
    requests = [Request(build_request(host, "/v2/models/slow/infer", body))]
    rate = 40.0
    done = run(slow_server, requests, Load(rate=rate, num_requests=120, seed=11))
    starts = np.sort([r.start for r in done.results])
    assert all(r.ok for r in done.results)
    gaps = np.diff(starts)
    assert stats.kstest(gaps, stats.expon(scale=1 / rate).cdf).pvalue > ALPHA
    # open loop: requests overlap (each takes 80 ms, arrivals every 25 ms on average)
    assert done.duration < 120 / rate + 1.0


def test_closed_loop_bounds():
    with pytest.raises(ValueError):
        Load(concurrency=1)  # no bound
    with pytest.raises(ValueError):
        Load(concurrency=1, rate=1.0, num_requests=1)


def test_a_server_that_closes_after_each_answer_costs_no_request():
    """Like llama.cpp's server after a streamed answer: the close can arrive just after
    the client reused the connection; that request never reached the server and is
    sent again on a new connection, as HTTP clients do, instead of counting an error."""
    import asyncio
    import threading

    answered = 0

    async def handle(reader, writer):
        nonlocal answered
        await reader.readuntil(b"\r\n\r\n")
        answered += 1  # before the answer: the client may finish before drain returns
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.02)  # keep-alive, then close: the client may reuse it first
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        requests = [Request(build_request(url.removeprefix("http://"), "/x", b"{}"))]
        done = run(url, requests, Load(concurrency=4, num_requests=40))
        assert [r.error for r in done.results if not r.ok] == []
        assert len(done.results) == 40 and answered == 40
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
