"""Ensembles through the official tritonclient (HTTP and gRPC): the shipped bow_text
against its two steps called one by one and against a numpy recomputation of
bow_classifier from its weights; 64 concurrent requests batched at every step (the step
models' own batch-size metrics); a failing step's error naming the step; and the checks
at load (unknown model, unmapped tensor, cycle), each naming the step."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, XY_CONFIG, write_model
from tests.server.conftest import DOUBLE, metric

sys.path.insert(0, str(ROOT / "tools"))
import build_models

TEXTS = [
    "A cat sat on the mat.",
    "Queues, queues and more queues",
    "",
    "Dynamic batching trades a little latency for a lot of throughput",
]
PROTOCOLS = {"http": triton_http, "grpc": triton_grpc}


def client(server, protocol: str):
    module = PROTOCOLS[protocol]
    url = server.grpc if protocol == "grpc" else server.url.removeprefix("http://")
    return module, module.InferenceServerClient(url)


def infer(server, protocol: str, model: str, name: str, array: np.ndarray, output: str):
    module, c = client(server, protocol)
    datatype = "BYTES" if array.dtype == object else "INT64"
    given = module.InferInput(name, list(array.shape), datatype)
    given.set_data_from_numpy(array)
    return c.infer(model, [given], outputs=[module.InferRequestedOutput(output)]).as_numpy(output)


def text(t: str) -> np.ndarray:
    return np.array([[t.encode()]], dtype=object)


def bow_reference(ids: np.ndarray) -> np.ndarray:
    w = build_models.bow_weights()
    logits = w["embedding"][ids].mean(0) @ w["weight"] + w["bias"]
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_equals_its_steps_called_one_by_one(pipeline_server, protocol):
    for t in TEXTS:
        got = infer(pipeline_server, protocol, "bow_text", "text", text(t), "probs")
        ids = infer(pipeline_server, protocol, "bow_tokenizer", "text", text(t), "input_ids")
        probs = infer(pipeline_server, protocol, "bow_classifier", "input_ids", ids, "probs")
        assert got.shape == (1, 4)
        np.testing.assert_array_equal(got, probs)
        np.testing.assert_allclose(got[0], bow_reference(ids[0]), rtol=1e-5, atol=1e-6)


def test_ensemble_labels_through_the_classification_extension(pipeline_server):
    _, c = client(pipeline_server, "http")
    given = triton_http.InferInput("text", [1, 1], "BYTES")
    given.set_data_from_numpy(text(TEXTS[0]))
    top = triton_http.InferRequestedOutput("probs", class_count=1)
    label = c.infer("bow_text", [given], outputs=[top]).as_numpy("probs")[0, 0].decode()
    probs = infer(pipeline_server, "http", "bow_text", "text", text(TEXTS[0]), "probs")[0]
    names = (ROOT / "models" / "bow_text" / "labels.txt").read_text().splitlines()
    score, index, name = label.split(":")
    assert int(index) == int(np.argmax(probs)) and name == names[int(index)]
    assert float(score) == pytest.approx(probs.max(), abs=1e-6)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_metadata_statistics_and_health_like_any_model(pipeline_server, protocol):
    _, c = client(pipeline_server, protocol)
    assert c.is_model_ready("bow_text")
    meta = c.get_model_metadata("bow_text", as_json=True) if protocol == "grpc" else None
    meta = meta or c.get_model_metadata("bow_text")
    assert meta["platform"] == "ensemble"
    assert meta["inputs"][0]["name"] == "text" and meta["outputs"][0]["name"] == "probs"
    infer(pipeline_server, protocol, "bow_text", "text", text("stats"), "probs")
    kwargs = {"as_json": True} if protocol == "grpc" else {}
    stats = c.get_inference_statistics("bow_text", **kwargs)["model_stats"][0]
    assert int(stats["inference_count"]) >= 1
    assert metric(pipeline_server.url, "bitserve_request_success_total", model="bow_text") >= 1


def test_64_concurrent_ensemble_requests_batch_at_every_step(pipeline_server):
    url = pipeline_server.url
    steps = ("bow_tokenizer", "bow_classifier")
    before = {m: metric(url, "bitserve_batch_size_count", model=m) for m in steps}
    rows_before = {m: metric(url, "bitserve_batch_size_sum", model=m) for m in steps}
    answers = asyncio.run(_concurrently(url.removeprefix("http://"), 64))
    assert all(a.shape == (1, 4) for a in answers)
    for m in steps:
        batches = metric(url, "bitserve_batch_size_count", model=m) - before[m]
        rows = metric(url, "bitserve_batch_size_sum", model=m) - rows_before[m]
        assert rows == 64, m
        assert batches < 64, f"{m}: 64 rows in {batches} batches"


async def _concurrently(url: str, count: int) -> list[np.ndarray]:
    """`count` bow_text requests in flight at once (tritonclient's asyncio client)."""
    import tritonclient.http.aio as triton_aio

    async with triton_aio.InferenceServerClient(url, conn_limit=count) as c:

        async def one(i: int) -> np.ndarray:
            given = triton_aio.InferInput("text", [1, 1], "BYTES")
            given.set_data_from_numpy(text(f"request {i} " + "word " * (i % 7)))
            return (await c.infer("bow_text", [given])).as_numpy("probs")

        return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_failing_step_fails_the_request_naming_the_step(pipeline_server, protocol):
    module, c = client(pipeline_server, protocol)
    x = module.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[-1.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as failed:
        c.infer("xy_chain", [x])
    message = failed.value.message()
    assert "ensemble 'xy_chain' step 2 (model 'boom')" in message
    assert "negative" in message
    x.set_data_from_numpy(np.array([[3.0]], dtype=np.float32))
    assert c.infer("xy_chain", [x]).as_numpy("y")[0, 0] == 7.0  # (3 * 2) + 1


# ------------------------------------------------------------------ load checks

STEP = """
[[ensemble_scheduling.step]]
model_name = "{model}"
input_map = {{ {inputs} }}
output_map = {{ {outputs} }}
"""
ENSEMBLE_HEAD = XY_CONFIG.replace('backend = "python"', 'backend = "ensemble"')
TWO_INPUTS = XY_CONFIG + '[[input]]\nname = "z"\ndatatype = "FP32"\ndims = [1]\n'


def ensemble(*steps: tuple[str, str, str]) -> str:
    body = "".join(STEP.format(model=m, inputs=i, outputs=o) for m, i, o in steps)
    return ENSEMBLE_HEAD + body


BROKEN = {
    "unknown model": (
        ensemble(("double", 'x = "x"', 'y = "a"'), ("ghost", 'x = "a"', 'y = "y"')),
        ["step 2 (model 'ghost')", "unknown model 'ghost'"],
    ),
    "unmapped input": (
        ensemble(("pair", 'x = "x"', 'y = "y"')),
        ["step 1 (model 'pair')", "['z'] are not mapped"],
    ),
    "not an input": (
        ensemble(("double", 'x = "x", w = "x"', 'y = "y"')),
        ["step 1 (model 'double')", "'w', not an input"],
    ),
    "unwritten tensor": (
        ensemble(("double", 'x = "nowhere"', 'y = "y"')),
        ["step 1 (model 'double')", "reads 'nowhere'"],
    ),
    "cycle": (
        ensemble(
            ("double", 'x = "b"', 'y = "a"'),
            ("double", 'x = "a"', 'y = "b"'),
            ("double", 'x = "x"', 'y = "y"'),
        ),
        ["cycle", "step 1 (model 'double')", "step 2 (model 'double')"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_ensemble_is_refused_at_load_naming_the_step(tmp_path, case):
    from bitserve.repository.repository import Repository

    config, expected = BROKEN[case]
    write_model(tmp_path, "double", XY_CONFIG, DOUBLE)
    write_model(tmp_path, "pair", TWO_INPUTS, DOUBLE)
    write_model(tmp_path, "broken", config)
    repository = Repository(tmp_path)
    repository.scan()
    asyncio.run(_load(repository))
    error = repository.models["broken"].error
    assert error is not None and all(e in error for e in expected), error
    assert repository.models["double"].error is None  # the others still serve


async def _load(repository) -> None:
    await repository.load_all()
    await repository.unload_all()


def test_an_ensemble_is_ready_only_while_its_steps_are(tmp_path):
    from bitserve.repository.repository import ModelUnavailable, Repository

    write_model(tmp_path, "double", XY_CONFIG, DOUBLE)
    write_model(
        tmp_path,
        "twice",
        ensemble(("double", 'x = "x"', 'y = "a"'), ("double", 'x = "a"', 'y = "y"')),
    )

    async def scenario() -> None:
        repository = Repository(tmp_path)
        repository.scan()
        await repository.load_all()
        answer = await repository.calls.infer("twice", {"x": np.array([[1.5]], np.float32)})
        assert answer["y"][0, 0] == 6.0
        await repository.unload_model("double")
        with pytest.raises(ModelUnavailable):
            repository.get("twice")
        assert "double" in (repository.not_ready_reason() or "")
        await repository.unload_all()

    asyncio.run(scenario())


def test_a_cancelled_ensemble_request_leaves_its_steps_queue(tmp_path):
    """The caller goes away while its first step waits behind another request at `slow`
    (one instance, 1 s a request): the step leaves that queue and never runs."""
    from bitserve.inference import ClientGone, InferRequest
    from bitserve.repository.repository import Repository
    from tests.server.conftest import SLOW

    write_model(tmp_path, "slow", XY_CONFIG, SLOW)
    write_model(tmp_path, "double", XY_CONFIG, DOUBLE)
    steps = (("slow", 'x = "x"', 'y = "a"'), ("double", 'x = "a"', 'y = "y"'))
    write_model(tmp_path, "pipe", ensemble(*steps))

    async def scenario() -> None:
        repository = Repository(tmp_path)
        repository.scan()
        await repository.load_all()
        pipe, slow = repository.get("pipe"), repository.get("slow")
        x = np.array([[1.0]], np.float32)
        first = pipe.start(InferRequest({"x": x}, 1, ()))
        second = pipe.start(InferRequest({"x": x}, 1, ()))
        while slow.report().queued < 1:  # the second waits behind the first
            await asyncio.sleep(0.01)
        second.cancel(ClientGone("client disconnected"))
        with pytest.raises(asyncio.CancelledError):
            await second.result
        assert (await first.result)["y"][0, 0] == 2.0
        stats = slow.report().batch
        assert stats.cancelled == 1 and stats.execution_count == 1
        await repository.unload_all()

    asyncio.run(scenario())


def test_loading_only_the_ensemble_loads_its_steps(tmp_path):
    """--model-control explicit --load-model twice, or a batch job naming only it."""
    from bitserve.repository.repository import Repository

    write_model(tmp_path, "double", XY_CONFIG, DOUBLE)
    write_model(tmp_path, "boom", XY_CONFIG, DOUBLE)  # not a step: stays unloaded
    write_model(
        tmp_path,
        "twice",
        ensemble(("double", 'x = "x"', 'y = "a"'), ("double", 'x = "a"', 'y = "y"')),
    )

    async def scenario() -> None:
        repository = Repository(tmp_path)
        repository.scan(["twice"])
        assert sorted(repository.models) == ["double", "twice"]
        await repository.load_all()
        answer = await repository.calls.infer("twice", {"x": np.array([[0.5]], np.float32)})
        assert answer["y"][0, 0] == 2.0
        await repository.unload_all()

    asyncio.run(scenario())


def test_a_bad_text_fails_alone_with_a_400_naming_the_step(pipeline_server):
    """bow_tokenizer answers a text that is not UTF-8 with a ValueError in that
    request's place: the requests batched with it are answered."""
    import tritonclient.http.aio as triton_aio

    async def mixed() -> list:
        url = pipeline_server.url.removeprefix("http://")
        async with triton_aio.InferenceServerClient(url, conn_limit=16) as c:

            async def one(raw: bytes):
                given = triton_aio.InferInput("text", [1, 1], "BYTES")
                given.set_data_from_numpy(np.array([[raw]], dtype=object), binary_data=True)
                try:
                    return (await c.infer("bow_text", [given])).as_numpy("probs")
                except InferenceServerException as e:
                    return e

            texts = [f"good text {i}".encode() for i in range(15)]
            return await asyncio.gather(*(one(t) for t in [*texts[:7], b"\xff\xfe", *texts[7:]]))

    answers = asyncio.run(mixed())
    bad = answers.pop(7)
    assert isinstance(bad, InferenceServerException) and bad.status() == "400"
    assert "step 1 (model 'bow_tokenizer')" in bad.message() and "UTF-8" in bad.message()
    assert all(isinstance(a, np.ndarray) and a.shape == (1, 4) for a in answers)
