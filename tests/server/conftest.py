"""The pipeline server that test_ensemble, test_bls and test_response_cache share: the
shipped bow_text ensemble with its two steps, tinylm (its response cache on), and small
python models that double, fail, sleep, call other models (BLS) or cache."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, XY_CONFIG, Server, free_port, write_model

DOUBLE = """
class Double:
    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""
BOOM = """
class Boom:
    def predict(self, inputs):
        if (inputs["x"] < 0).any():
            raise RuntimeError("boom cannot take a negative x")
        return {"y": inputs["x"] + 1}
"""
SLOW = """
import time

class Slow:
    def predict(self, inputs):
        time.sleep(1.0)
        return {"y": inputs["x"]}
"""
CHAIN = """
backend = "ensemble"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [1]
[[output]]
name = "y"
datatype = "FP32"
dims = [1]
[[ensemble_scheduling.step]]
model_name = "double"
input_map = { x = "x" }
output_map = { y = "doubled" }
[[ensemble_scheduling.step]]
model_name = "boom"
input_map = { x = "doubled" }
output_map = { y = "y" }
"""
TEXT_IN = """
backend = "python"
max_batch_size = 8
[[input]]
name = "text"
datatype = "BYTES"
dims = [1]
[[output]]
name = "probs"
datatype = "FP32"
dims = [4]
[dynamic_batching]
max_queue_delay_ms = 2
"""
# BLS, blocking: each text through bow_tokenizer then bow_classifier, one at a time.
BLS_TEXT = """
import numpy as np

class Pipeline:
    def setup(self, models):
        self.models = models

    def predict(self, inputs):
        rows = []
        for text in inputs["text"][:, 0]:
            one = {"text": np.array([[text]], dtype=object)}
            ids = self.models.request("bow_tokenizer", one).exec()
            if ids.has_error():
                raise ids.error()
            probs = self.models.request(
                "bow_classifier", {"input_ids": ids.as_numpy("input_ids")},
                requested_output_names=["probs"],
            ).exec()
            if probs.has_error():
                raise probs.error()
            rows.append(probs.as_numpy("probs")[0])
        return {"probs": np.stack(rows)}
"""
# BLS, awaited: every request of the batch calls the ensemble at once.
BLS_ASYNC = """
import asyncio

class Gathered:
    def setup(self, models):
        self.models = models

    async def execute(self, requests):
        calls = [self.models.request("bow_text", {"text": r["text"]}) for r in requests]
        answers = await asyncio.gather(*(call.async_exec() for call in calls))
        for a in answers:
            if a.has_error():
                raise a.error()
        return [{"probs": a.as_numpy("probs")} for a in answers]
"""
# BLS, a stream from the LLM: the pieces joined, at most `limit` of them.
BLS_STREAM = """
import json
import numpy as np

class Streamed:
    def setup(self, models):
        self.models = models

    def predict(self, inputs):
        prompt = inputs["prompt"][0]
        limit = int(inputs["limit"][0])
        params = json.dumps({"max_tokens": 200, "temperature": 0, "ignore_eos": True})
        request = self.models.request(
            "tinylm",
            {"text_input": np.array([prompt], dtype=object),
             "sampling_parameters": np.array([params.encode()], dtype=object)},
        )
        pieces = []
        for response in request.exec(decoupled=True):
            if response.has_error():
                raise response.error()
            pieces.append(response.as_numpy("text_output")[0])
            if len(pieces) == limit:
                break
        return {"text": np.array([b"".join(pieces)], dtype=object),
                "pieces": np.array([len(pieces)], dtype=np.int64)}
"""
STREAM_CONFIG = """
backend = "python"
[[input]]
name = "prompt"
datatype = "BYTES"
dims = [1]
[[input]]
name = "limit"
datatype = "INT64"
dims = [1]
[[output]]
name = "text"
datatype = "BYTES"
dims = [1]
[[output]]
name = "pieces"
datatype = "INT64"
dims = [1]
"""
# BLS errors: the callee's error message comes back as the output (model, x, timeout).
BLS_ERRORS = """
import numpy as np

class Errors:
    def setup(self, models):
        self.models = models

    def predict(self, inputs):
        target = inputs["model"][0].decode()
        x = np.array([[float(inputs["x"][0])]], dtype=np.float32)
        answer = self.models.request(target, {"x": x}, timeout=int(inputs["timeout_us"][0])).exec()
        error = answer.error()
        text = f"{type(error).__name__}: {error}" if error is not None else "ok"
        return {"error": np.array([text.encode()], dtype=object)}
"""
ERRORS_CONFIG = """
backend = "python"
[[input]]
name = "model"
datatype = "BYTES"
dims = [1]
[[input]]
name = "x"
datatype = "FP32"
dims = [1]
[[input]]
name = "timeout_us"
datatype = "INT64"
dims = [1]
[[output]]
name = "error"
datatype = "BYTES"
dims = [1]
"""
CACHED = """
class Cached:
    def predict(self, inputs):
        return {"y": inputs["x"] * 3}
"""
# tinylm's steps slow down only for prompts of 20 tokens or more (the BLS stream test's):
# its 200 tokens then take a minute, so only an abort can end it within the test.
SLOW_LONG_PROMPTS = """
import time

def hook(seqs):
    if any(s.num_prompt_tokens >= 20 for s in seqs):
        time.sleep(0.3)
"""


def build_pipeline_repository(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    from build_models import build

    repository = root / "models"
    for name in ("bow_classifier", "bow_tokenizer", "bow_text", "tinylm"):
        shutil.copytree(ROOT / "models" / name, repository / name)
    build(repository, names=["bow_classifier"])
    with (repository / "tinylm" / "config.toml").open("a") as config:
        config.write("\n[response_cache]\nenable = true\n")
    batched = XY_CONFIG + "[dynamic_batching]\nmax_queue_delay_ms = 2\n"
    write_model(repository, "double", batched, DOUBLE)
    write_model(repository, "boom", batched, BOOM)
    write_model(repository, "slow", XY_CONFIG, SLOW)
    write_model(repository, "xy_chain", CHAIN)
    write_model(repository, "bls_text", TEXT_IN, BLS_TEXT)
    # 50 ms: the 32 callers share batches even when a loaded box slows the 16 client threads.
    gathered = TEXT_IN.replace("max_queue_delay_ms = 2", "max_queue_delay_ms = 50")
    write_model(repository, "bls_async", gathered, BLS_ASYNC)
    write_model(repository, "bls_stream", STREAM_CONFIG, BLS_STREAM)
    write_model(repository, "bls_errors", ERRORS_CONFIG, BLS_ERRORS)
    cache = "[response_cache]\nenable = true\nmax_bytes = 2048\n"
    write_model(repository, "cached", batched + cache, CACHED)
    (root / "slow_long_prompts.py").write_text(SLOW_LONG_PROMPTS)
    return repository


@pytest.fixture(scope="session")
def pipeline_server(tmp_path_factory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("pipeline")
    repository = build_pipeline_repository(root)
    env = {"BITSERVE_LLM_FAULT_HOOK": "slow_long_prompts:hook", "PYTHONPATH": str(root)}
    port = free_port()
    server = Server(repository, "--grpc-port", str(port), env=env)
    server.grpc = f"127.0.0.1:{port}"
    yield server
    server.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """The server's sample `name`, summed over the samples whose labels match."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wait_for(check, limit: float = 30.0) -> None:
    """Until `check()` is true (a server's asynchronous effect), at most `limit` s."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "the server never reached the state"
        time.sleep(0.05)
