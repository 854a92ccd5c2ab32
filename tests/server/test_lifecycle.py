"""The repository extension, atomic version swaps under load, polling, SIGTERM drain."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ROOT, XY_CONFIG, Server, write_model

VERSIONED = """
import time
import numpy as np

class Model:
    def setup(self, model_dir):
        self.version = int(model_dir.name)
        time.sleep(0.3)              # a load that takes a while: the swap must hide it

    def predict(self, inputs):
        x = inputs["x"]
        return {"y": x, "v": np.full((len(x), 1), self.version, dtype=np.int64)}
"""

CONFIG = (
    XY_CONFIG
    + """[[output]]
name = "v"
datatype = "INT64"
dims = [1]
[dynamic_batching]
max_queue_delay_ms = 1
[version_policy]
specific = [{version}]
"""
)

SLOW = """
import time

class Model:
    def predict(self, inputs):
        time.sleep(0.5)
        return {"y": inputs["x"], "v": (inputs["x"] * 0).astype("int64")}
"""

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXPLICIT = ("--model-control", "explicit", "--load-model", "*", "--admin-token", TOKEN)


def body(x: float = 1.0) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [x]}]}


def make_repo(root, names=("swap", "other"), code=VERSIONED):
    for name in names:
        folder = write_model(root, name, CONFIG.format(version=1), code)
        (folder / "2").mkdir()
        (folder / "2" / "model.py").write_text((folder / "1" / "model.py").read_text())
    return root


def version_of(answer: httpx.Response) -> int:
    return next(o["data"][0] for o in answer.json()["outputs"] if o["name"] == "v")


def test_management_is_off_without_a_token(tmp_path):
    server = Server(make_repo(tmp_path / "m"), "--model-control", "explicit", "--load-model", "*")
    try:
        r = httpx.post(server.url + "/v2/repository/models/swap/unload")
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]
        assert httpx.post(server.url + "/v2/repository/index").status_code == 403
        assert httpx.post(server.url + "/v2/models/swap/infer", json=body()).status_code == 200
    finally:
        server.stop()


def test_wrong_token_is_401_and_changes_nothing(tmp_path):
    server = Server(
        make_repo(tmp_path / "m"),
        "--model-control",
        "explicit",
        "--load-model",
        "*",
        "--admin-token",
        TOKEN,
    )
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            r = httpx.post(server.url + "/v2/repository/models/swap/unload", headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.post(server.url + "/v2/models/swap/infer", json=body()).status_code == 200
        index = httpx.post(server.url + "/v2/repository/index", headers=AUTH).json()
        assert {(m["name"], m["state"]) for m in index} == {("swap", "READY"), ("other", "READY")}
    finally:
        server.stop()


def test_model_control_none_refuses_load_and_unload(tmp_path):
    server = Server(make_repo(tmp_path / "m"), "--admin-token", TOKEN)
    try:
        r = httpx.post(server.url + "/v2/repository/models/swap/unload", headers=AUTH)
        assert r.status_code == 403 and "none" in r.json()["error"]
        assert httpx.post(server.url + "/v2/models/swap/infer", json=body()).status_code == 200
    finally:
        server.stop()


def test_explicit_mode_loads_on_request_and_unloads(tmp_path):
    server = Server(
        make_repo(tmp_path / "m"),
        "--model-control",
        "explicit",
        "--load-model",
        "other",
        "--admin-token",
        TOKEN,
    )
    url = server.url
    try:
        assert httpx.post(url + "/v2/models/swap/infer", json=body()).status_code == 404
        states = {
            m["name"]: m["state"]
            for m in httpx.post(url + "/v2/repository/index", headers=AUTH).json()
        }
        assert states == {"swap": "UNLOADED", "other": "READY"}
        assert httpx.post(url + "/v2/repository/models/swap/load", headers=AUTH).status_code == 200
        assert version_of(httpx.post(url + "/v2/models/swap/infer", json=body())) == 1
        r = httpx.post(url + "/v2/repository/models/nothere/load", headers=AUTH)
        assert r.status_code == 404
        assert (
            httpx.post(url + "/v2/repository/models/swap/unload", headers=AUTH).status_code == 200
        )
        r = httpx.post(url + "/v2/models/swap/infer", json=body())
        assert r.status_code == 503 and "unloaded" in r.json()["error"]
        assert httpx.get(url + "/v2/health/ready").status_code == 200  # unloaded on purpose
    finally:
        server.stop()


def test_broken_reload_keeps_the_old_version_serving(tmp_path):
    root = make_repo(tmp_path / "m")
    server = Server(
        root, "--model-control", "explicit", "--load-model", "*", "--admin-token", TOKEN
    )
    try:
        (root / "swap" / "config.toml").write_text(CONFIG.format(version=2) + "bogus = 1\n")
        r = httpx.post(server.url + "/v2/repository/models/swap/load", headers=AUTH)
        assert r.status_code == 400 and "bogus" in r.json()["error"]
        answer = httpx.post(server.url + "/v2/models/swap/infer", json=body())
        assert answer.status_code == 200 and version_of(answer) == 1
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    finally:
        server.stop()


def test_ten_version_swaps_under_load_drop_nothing(tmp_path):
    root = make_repo(tmp_path / "m")
    server = Server(
        root, "--model-control", "explicit", "--load-model", "*", "--admin-token", TOKEN
    )
    url = server.url
    stop = threading.Event()
    statuses: Counter = Counter()
    versions: Counter = Counter()

    def client(model: str) -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(f"{url}/v2/models/{model}/infer", json=body())
                statuses[(model, r.status_code)] += 1
                if r.status_code == 200 and model == "swap":
                    versions[version_of(r)] += 1

    try:
        with ThreadPoolExecutor(6) as pool:
            clients = [pool.submit(client, m) for m in ("swap",) * 4 + ("other",) * 2]
            for i in range(10):
                version = 2 if i % 2 == 0 else 1
                (root / "swap" / "config.toml").write_text(CONFIG.format(version=version))
                r = httpx.post(url + "/v2/repository/models/swap/load", headers=AUTH, timeout=30)
                assert r.status_code == 200, r.text
                time.sleep(0.1)
            stop.set()
            for c in clients:
                c.result()
        assert {code for (_, code) in statuses} == {200}, statuses
        assert statuses[("swap", 200)] > 50 and statuses[("other", 200)] > 20
        assert versions[1] > 0 and versions[2] > 0
    finally:
        stop.set()
        server.stop()


def test_poll_mode_follows_the_folder(tmp_path):
    root = make_repo(tmp_path / "m", names=("swap",))
    server = Server(root, "--model-control", "poll", "--repository-poll-secs", "0.2")
    try:
        write_model(root, "late", CONFIG.format(version=1), VERSIONED)
        deadline = time.monotonic() + 20
        while httpx.post(server.url + "/v2/models/late/infer", json=body()).status_code != 200:
            assert time.monotonic() < deadline, "a new model folder was never loaded"
            time.sleep(0.1)
        (root / "swap" / "config.toml").write_text(CONFIG.format(version=2))
        while version_of(httpx.post(server.url + "/v2/models/swap/infer", json=body())) != 2:
            assert time.monotonic() < deadline, "a config change was never picked up"
            time.sleep(0.1)
    finally:
        server.stop()


@pytest.mark.parametrize("inflight", [6])
def test_sigterm_drains_in_flight_then_exits_zero(tmp_path, inflight):
    root = tmp_path / "m"
    write_model(root, "slow", CONFIG.format(version=1), SLOW)
    server = Server(root, "--drain-timeout", "20")
    url = server.url
    with ThreadPoolExecutor(inflight) as pool:
        running = [
            pool.submit(httpx.post, url + "/v2/models/slow/infer", json=body(), timeout=30)
            for _ in range(inflight)
        ]
        wait_for_metric(url, "bitserve_inflight_requests", inflight)  # all in, however slow
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert httpx.get(url + "/v2/health/ready").status_code == 503
        late = httpx.post(url + "/v2/models/slow/infer", json=body())
        assert late.status_code == 503 and "draining" in late.json()["error"]
        assert [f.result().status_code for f in running] == [200] * inflight
    assert server.process.wait(30) == 0


def metric(url: str, name: str) -> float:
    """The server's sample `name`, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    families = text_string_to_metric_families(text)
    return sum(s.value for family in families for s in family.samples if s.name == name)


def wait_for_metric(url: str, name: str, value: float, limit: float = 30.0) -> None:
    """Until the server's sample `name` (summed over its labels) reaches `value`."""
    deadline = time.monotonic() + limit
    while (total := metric(url, name)) < value:
        assert time.monotonic() < deadline, f"{name} stayed at {total} (waiting for {value})"
        time.sleep(0.05)


def test_sigterm_lets_openai_streams_and_completions_finish(tmp_path):
    """The drain waits for OpenAI requests too (they hold a lease on their version, not
    the v2 in-flight count): each of them ends whole, then the process exits 0."""
    import shutil

    root = tmp_path / "m"
    shutil.copytree(ROOT / "models" / "tinylm", root / "tinylm")
    # tinylm answers 240 tokens in well under a second: 10 ms a step (the engine's test
    # hook) keeps each request in flight for 2.4 s or more, so SIGTERM lands mid-answer
    (tmp_path / "slow_steps.py").write_text(
        "import time\n\ndef hook(seqs):\n    time.sleep(0.01)\n"
    )
    env = {"BITSERVE_LLM_FAULT_HOOK": "slow_steps:hook", "PYTHONPATH": str(tmp_path)}
    server = Server(root, "--drain-timeout", "60", env=env)
    try:
        url = server.url
        body = {"model": "tinylm", "prompt": "In the beginning", "max_tokens": 240}
        body["ignore_eos"] = True

        def stream() -> tuple[int, int]:
            chunks = 0
            with httpx.stream(
                "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120
            ) as r:
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                return r.status_code, chunks

        def whole() -> tuple[int, int]:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            return r.status_code, r.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(f) for f in (stream, stream, whole, whole)]
            # Every request has its first token (the server holds all four: on a slow
            # client they start apart), and the drain has them still generating.
            wait_for_metric(url, "bitserve_llm_time_to_first_token_seconds_count", 4)
            generating = metric(url, "bitserve_llm_num_requests_running")
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            late = httpx.post(url + "/v1/completions", json=body)
            assert late.status_code == 503
            answers = [f.result() for f in running]
        assert generating >= 1
        assert [code for code, _ in answers] == [200] * 4
        assert all(n >= 240 for _, n in answers[2:]), answers  # the whole answer, not a cut
        assert all(n > 100 for _, n in answers[:2]), answers
        assert server.process.wait(60) == 0
    finally:  # a failed check must not leave the server running
        server.stop()
