"""`--workers 2`: two local engine processes write what one process writes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.offline.conftest import (
    answers,
    batch_command,
    children,
    key,
    openai_line,
    read_output,
    run_batch,
)


def completions(n: int, max_tokens: int = 8, **extra) -> list[str]:
    body = {"model": "chat", "temperature": 0, **extra}
    return [
        openai_line(
            f"r{i}",
            "/v1/completions",
            {**body, "prompt": f"p {i}", "max_tokens": max_tokens + i % 5},
        )
        for i in range(n)
    ]


def test_two_workers_output_equals_single_process(batch_repo, tmp_path):
    chat = {"model": "chat", "max_tokens": 6, "temperature": 0}
    chats = [
        openai_line(
            f"c{i}",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": f"hi {i}"}]},
        )
        for i in range(10)
    ]
    bad = [
        "{broken",
        openai_line("u", "/v1/completions", {"model": "nope", "prompt": "x"}),
        openai_line("r3", "/v1/completions", {"model": "chat", "prompt": "again"}),
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([bad[0], *completions(60), *chats, *bad[1:]]) + "\n")
    run_batch(batch_repo, inp, tmp_path / "one.jsonl")
    summary = run_batch(batch_repo, inp, tmp_path / "two.jsonl", "--workers", "2")
    assert "done 70, failed 3" in summary
    two = answers(tmp_path / "two.jsonl")
    assert two == answers(tmp_path / "one.jsonl")
    codes = {k: error["code"] for k, (_, error) in two.items() if error}
    assert codes == {
        "line:1": "invalid_json",
        "u": "model_not_found",
        "line:73": "duplicate_custom_id",
    }


def workers_of(pid: int) -> list[int]:
    """The batch worker processes of `pid` (not multiprocessing's resource tracker)."""
    return [c for c in children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_worker_that_dies_fails_the_run_and_a_rerun_finishes_it(batch_repo, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(completions(2000, max_tokens=60, ignore_eos=True)) + "\n")
    command = batch_command(batch_repo, inp, out, "--workers", "2", "--max-in-flight", "32")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.02)  # the workers are loaded and answering
    victims = workers_of(process.pid)
    assert len(victims) == 2 and process.poll() is None
    os.kill(victims[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)  # fails at once, no hang
    assert process.returncode != 0
    assert "batch worker" in stderr and "killed by signal 9" in stderr, stderr[-2000:]
    assert "run the same command again" in stderr
    written = len(read_output(out))
    assert 0 < written < 2000
    summary = run_batch(batch_repo, inp, out, "--workers", "2")
    assert f"skipped {written}" in summary
    keys = [key(d) for d in read_output(out)]
    assert len(keys) == len(set(keys)) == 2000
