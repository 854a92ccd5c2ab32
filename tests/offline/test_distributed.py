"""`--ray`: a local Ray cluster of 2 workers writes what one process writes."""

from __future__ import annotations

import pytest

from tests.offline.conftest import answers, openai_line, run_batch

ray = pytest.importorskip("ray")


def test_ray_cluster_output_equals_single_process(batch_repo, tmp_path):
    lines = [
        openai_line(
            f"r{i}",
            "/v1/completions",
            {"model": "chat", "prompt": f"p {i}", "max_tokens": 8, "temperature": 0},
        )
        for i in range(60)
    ]
    lines += ["{broken", openai_line("u", "/v1/completions", {"model": "nope", "prompt": "x"})]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    run_batch(batch_repo, inp, tmp_path / "one.jsonl")
    context = ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        address = context.address_info["gcs_address"]
        run_batch(batch_repo, inp, tmp_path / "ray.jsonl", "--ray", address, "--ray-workers", "2")
    finally:
        ray.shutdown()
    assert answers(tmp_path / "ray.jsonl") == answers(tmp_path / "one.jsonl")
