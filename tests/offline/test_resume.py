"""kill -9 at random moments, then resume: every record exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

from bitserve.offline.journal import Journal, progress_path
from tests.offline.conftest import (
    alive,
    batch_command,
    children,
    key,
    openai_line,
    read_output,
    run_batch,
)


def test_journal_drops_an_uncommitted_tail(tmp_path):
    out = tmp_path / "out.jsonl"
    journal = Journal.open(out, "f")
    journal.append([b'{"custom_id":"a","error":null}\n'], failed=0, tokens=0)
    journal._file.write(b'{"custom_id":"b","error":null}\n{"custom_id":"c"')  # never recorded
    journal._file.flush()
    resumed = Journal.open(out, "f")
    assert resumed.done_keys == {"a"}
    assert out.read_bytes() == b'{"custom_id":"a","error":null}\n'
    assert progress_path(out).exists()


def test_kill_nine_then_resume_gives_every_record_once(batch_repo, tmp_path):
    kill_nine_then_resume(batch_repo, tmp_path)


@pytest.mark.slow  # ~20 s: five starts of a parent and two workers
def test_kill_nine_with_two_workers_then_resume(batch_repo, tmp_path):
    kill_nine_then_resume(batch_repo, tmp_path, "--workers", "2", records=4000)


def kill_nine_then_resume(batch_repo, tmp_path, *args: str, records: int = 2000) -> None:
    """kill -9 the command four times at random points of its output (its worker
    processes must die with it), then run it to the end: every record exactly once."""
    rng = random.Random(7)
    inp = tmp_path / "in.jsonl"
    ids = [f"r{i}" for i in range(records)]  # enough work to still be running at each kill
    body = {"model": "chat", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    lines = [openai_line(i, "/v1/completions", {**body, "prompt": f"p {i}"}) for i in ids]
    inp.write_text("\n".join([*lines, "{broken"]) + "\n")
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    kills = 0
    for _ in range(4):
        command = batch_command(batch_repo, inp, out, "--max-in-flight", "64", *args)
        process = subprocess.Popen(command, env=env)
        before = out.stat().st_size if out.exists() else 0
        target = before + rng.randint(1, 20_000)  # somewhere in the next stretch of output
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            if out.exists() and out.stat().st_size >= target:
                time.sleep(rng.random() * 0.1)  # mid-write, mid-fsync, mid-progress
                break
            time.sleep(0.01)
        if process.poll() is None:
            orphans = children(process.pid)
            os.kill(process.pid, signal.SIGKILL)
            kills += 1
            deadline = time.monotonic() + 10
            while any(map(alive, orphans)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(map(alive, orphans)), "a worker outlived its parent"
        process.wait()
    assert kills >= 3, f"the job outran the kills ({kills}): give it more work"
    summary = run_batch(batch_repo, inp, out, "--max-in-flight", "64", *args)
    assert "skipped" in summary
    docs = read_output(out)
    keys = [key(d) for d in docs]
    assert len(keys) == len(set(keys)), "a record was answered twice"
    assert set(keys) == {*ids, f"line:{len(ids) + 1}"}
    assert all(d["error"] is None for d in docs if d["custom_id"])
    texts = {
        d["custom_id"]: d["response"]["body"]["choices"][0]["text"]
        for d in docs[:50]
        if d["custom_id"]
    }
    assert all(texts.values())
