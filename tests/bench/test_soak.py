"""bench/soak.py: its verdict on timelines with and without a leak, and the bounded run
that `make test` keeps (issue 35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import soak
from tests.conftest import ROOT

MiB = 2**20


def timeline(minutes: float, rss_per_hour: float, seed: int = 0) -> list[dict]:
    """A sample every 2 s: RSS rising by `rss_per_hour` over allocator noise, fds and
    threads flat with noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(int(minutes * 30)):
        t = 2.0 * i
        rows.append(
            {
                "t": t,
                "rss": 1000 * MiB + rss_per_hour * t / 3600 + rng.normal(0, 4 * MiB),
                "rss_children": 0,
                "fds": 40 + int(rng.integers(0, 3)),
                "threads": 50 + int(rng.integers(0, 2)),
            }
        )
    return rows


def verdict(rows, rss_bound=None):
    return soak.verdict([], rss_bound, rows, [], 60.0, {}, 0.0, {"ok": True})


def test_a_flat_run_passes_and_a_leak_fails_on_rss():
    clean = verdict(timeline(10, 0.0))
    assert clean["ok"], clean["checks"]
    leak = verdict(timeline(10, 500 * MiB))
    assert not leak["ok"] and not leak["checks"]["rss"]["ok"]
    low, high = leak["checks"]["rss"]["ci95"]
    assert low < 500 * MiB < high  # the interval holds the planted rate


def test_growing_file_descriptors_fail():
    rows = timeline(10, 0.0)
    for i, row in enumerate(rows):
        row["fds"] += i // 10  # one more every 20 s
    assert not verdict(rows)["checks"]["fds"]["ok"]


def test_a_5xx_outside_a_chaos_event_fails_and_one_inside_is_owed_to_it():
    base = dict(kind="v2_json", protocol="v2-json", model="mlp_proc", seconds=0.1, expected="ok")
    lost = dict(base, start=100.0, status=503, retry_after=True)
    event = soak.Event("kill -9 instance", 99.0, 101.0, ["mlp_proc"])
    rows = timeline(4, 0.0)
    owed = soak.verdict([lost], None, rows, [event], 60.0, {}, 0.0, {"ok": True})
    assert owed["checks"]["requests"]["ok"]
    alone = soak.verdict([lost], None, rows, [], 60.0, {}, 0.0, {"ok": True})
    assert not alone["checks"]["requests"]["ok"]
    bug = dict(base, start=100.0, status=500, retry_after=False)
    inside = soak.verdict([bug], None, rows, [event], 60.0, {}, 0.0, {"ok": True})
    assert not inside["checks"]["requests"]["ok"]  # a 500 is not owed to a kill -9


def test_a_500_is_owed_only_to_an_engine_fault_and_once_per_request_it_failed():
    rows = timeline(4, 0.0)
    chat = dict(kind="chat", protocol="openai", model="tinylm", seconds=0.1, expected="ok")
    failed = dict(chat, start=100.0, status=500, retry_after=False)
    fault = soak.Event("engine step fault", 99.0, 101.0, ["tinylm"], failures=1)
    one = soak.verdict([failed], None, rows, [fault], 60.0, {}, 0.0, {"ok": True})
    assert one["checks"]["requests"]["ok"]
    two = soak.verdict([failed, dict(failed)], None, rows, [fault], 60.0, {}, 0.0, {"ok": True})
    assert two["checks"]["requests"]["unexpected"] == 1
    broken = soak.Event("batch job", 99.0, 101.0, [], "exit 1", ok=False)
    assert not soak.verdict([], None, rows, [broken], 60.0, {}, 0.0, {"ok": True})["ok"]


def test_the_fault_hook_fails_its_victim_in_every_step_and_kills_the_loop_once(
    tmp_path, monkeypatch
):
    from bitserve.llm import SamplingParams
    from bitserve.llm.sequence import Sequence

    monkeypatch.setenv(soak.FAULTS_ENV, str(tmp_path))
    monkeypatch.setattr(soak, "_victims", set())
    a, b = (Sequence(name, [1, 2], SamplingParams()) for name in ("a", "b"))
    soak.engine_fault([a, b])  # nothing asked: the step runs
    (tmp_path / "fail").touch()
    with pytest.raises(RuntimeError, match="injected"):
        soak.engine_fault([a, b])
    assert (tmp_path / "victims").read_text() == "a\n" and not (tmp_path / "fail").exists()
    soak.engine_fault([b])  # alone, the other request goes on
    with pytest.raises(RuntimeError):
        soak.engine_fault([a])  # the victim fails alone too
    (tmp_path / "kill").touch()
    with pytest.raises(SystemExit):
        soak.engine_fault([b])
    soak.engine_fault([b])  # once


# The bounded soak: 2 minutes (1.5 in the default suite: ~2.3 min of wall with start
# and drain), 2 client processes x 4 loops, a chaos event every 10 s (on a loaded box
# a kill -9's restart can take 40 s: then only the first four kinds happen). RSS may grow 4 GiB/h: a
# clean run on a busy 2-core box still warms up at ~0.6 GiB/h (95% interval up to 0.8)
# in its last 80 s; the planted leak (1 MiB on ~14% of requests) grows ~15-20 GiB/h. The
# 400-chat overload probe is left to bench/overload.py and tests/server/test_overload.py:
# its 50 ms bound is a figure for a quiet box, not a check a loaded one can keep.
BOUNDED = ["--minutes", "2", "--clients", "2", "--concurrency", "4", "--rss-bound", "4096"]
BOUNDED += ["--overload", "0"]


def run_soak(tmp_path, *extra: str) -> tuple[int, dict]:
    run = subprocess.run(
        [sys.executable, "-m", "bench.soak", *BOUNDED, *extra, "--report", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=900,
    )
    return run.returncode, json.loads((tmp_path / "soak.json").read_text())


def test_the_bounded_soak_passes(tmp_path):
    code, result = run_soak(tmp_path, "--minutes", "1.5")  # ~2.3 min with start and drain
    failed = {k: c for k, c in result["checks"].items() if not c.get("ok")}
    assert code == 0 and result["ok"], failed


@pytest.mark.slow
def test_a_planted_leak_fails_the_bounded_soak(tmp_path):
    code, result = run_soak(tmp_path, "--plant-leak")
    assert code == 1 and not result["checks"]["rss"]["ok"], result["checks"]["rss"]
