"""The v2 codec (bitserve/api/v2.py) is the one both front-ends call.

tritonclient builds the wire messages (its HTTP client's JSON + binary body, its gRPC
client's `ModelInferRequest`): the same request decodes to the same `InferRequest`
from either, and the same mistake gets the same message naming the field. The
source checks keep it one codec: the v2 front-ends import no underscored name from
another module (a helper another module needs is public), and the LLM token stream
is written once, in generate.py, which the SSE and the gRPC encoders both iterate.
"""

from __future__ import annotations

import ast
import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.grpc import _utils as grpc_utils

from tests.conftest import ROOT

SERVER = ROOT / "bitserve" / "server"
V2_MODULES = [
    SERVER / "grpc_server.py",
    SERVER / "v2.py",
    SERVER / "generate.py",
    ROOT / "bitserve" / "api" / "v2.py",
]

CONFIG = {
    "name": "m",
    "backend": "python",
    "max_batch_size": 8,
    "input": [
        {"name": "x", "datatype": "FP32", "dims": [3]},
        {"name": "ids", "datatype": "INT64", "dims": [-1], "value_range": [0, 99]},
        {"name": "text", "datatype": "BYTES", "dims": [1], "optional": True},
    ],
    "output": [
        {"name": "y", "datatype": "FP32", "dims": [3]},
        {"name": "probs", "datatype": "FP32", "dims": [4]},
    ],
}
X = np.arange(6, dtype=np.float32).reshape(2, 3)
IDS = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int64)
TEXT = np.array([[b"a"], ["\u00e9".encode()]], dtype=object)
GOOD = [("x", "FP32", X), ("ids", "INT64", IDS), ("text", "BYTES", TEXT)]
OPTIONS = {"request_id": "r1", "priority": 2, "timeout": 5000}


def wires(inputs: list[tuple], outputs=(), binary=False, **options) -> dict:
    """One request as tritonclient's HTTP client sends it (JSON, or JSON + binary
    tensors) and as its gRPC client does (raw contents), serialized."""
    http_in, grpc_in = [], []
    for name, datatype, array in inputs:
        h = th.InferInput(name, list(array.shape), datatype)
        h.set_data_from_numpy(array, binary_data=binary)
        g = tg.InferInput(name, list(array.shape), datatype)
        g.set_data_from_numpy(array)
        http_in.append(h)
        grpc_in.append(g)
    http_out = [th.InferRequestedOutput(n, binary_data=binary, class_count=k) for n, k in outputs]
    grpc_out = [tg.InferRequestedOutput(n, class_count=k) for n, k in outputs]
    body, json_size = th.InferenceServerClient.generate_request_body(
        http_in, http_out or None, **options
    )
    message = grpc_utils._get_inference_request(
        "m", grpc_in, "", options.get("request_id", ""), grpc_out or None, 0, False, False,
        options.get("priority", 0), options.get("timeout"), None,
    )  # fmt: skip
    return {"http": [body, json_size], "grpc": message}


def priority_as_text() -> dict:
    """`priority` given as a string (tritonclient refuses to send one: edited in)."""
    case = wires(GOOD[:2])
    doc = json.loads(case["http"][0])
    doc["parameters"] = {"priority": "high"}
    case["http"] = [json.dumps(doc).encode(), None]
    case["grpc"].parameters["priority"].string_param = "high"
    return case


BAD = {
    "datatype": wires([("x", "FP64", X.astype(np.float64))]),
    "shape": wires([("x", "FP32", X[:, :2].copy())]),
    "batch size 9": wires([("x", "FP32", np.zeros((9, 3), np.float32))]),
    "unknown input 'nope'": wires([("nope", "FP32", X)]),
    "missing inputs ['x']": wires([("ids", "INT64", IDS)]),
    "values must be in [0, 99]": wires([("x", "FP32", X), ("ids", "INT64", IDS + 100)]),
    "disagree on the batch size": wires([("x", "FP32", X), ("ids", "INT64", IDS[:1])]),
    "unknown output 'z'": wires(GOOD[:2], outputs=[("z", 0)]),
    "parameter 'priority' must be a non-negative integer": priority_as_text(),
}


@pytest.fixture(scope="module")
def decoded() -> dict:
    """Every case decoded by bitserve's codec, in a process of its own."""
    cases = {
        "json": wires(GOOD, outputs=[("probs", 2), ("y", 0)], **OPTIONS),
        "binary": wires(GOOD, outputs=[("probs", 2), ("y", 0)], binary=True, **OPTIONS),
        **BAD,
    }
    job = {
        "config": CONFIG,
        "cases": [
            {
                "http": [base64.b64encode(c["http"][0]).decode(), c["http"][1]],
                "grpc": base64.b64encode(c["grpc"].SerializeToString()).decode(),
            }
            for c in cases.values()
        ],
    }
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("codec_decoder.py"))],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    return dict(zip(cases, json.loads(out.stdout), strict=True))


@pytest.mark.parametrize("wire", ["json", "binary"])
def test_the_same_request_decodes_the_same_from_both_wires(decoded, wire):
    http, grpc = decoded[wire]["http"], decoded[wire]["grpc"]
    assert "error" not in http and "error" not in grpc, (http, grpc)
    assert http == grpc
    dtype, shape, raw, _ = http["inputs"]["x"]
    assert np.frombuffer(base64.b64decode(raw), dtype).reshape(shape).tolist() == X.tolist()
    assert http["inputs"]["ids"][:2] == ["<i8", [2, 4]]
    assert http["inputs"]["text"][3] == ["a", "\u00e9".encode().decode("latin-1")]
    assert http["rows"] == 2
    assert http["outputs"] == ["probs", "y"]
    assert http["classification"] == {"probs": 2}
    assert (http["id"], http["priority"], http["timeout_us"]) == ("r1", 2, 5000)


@pytest.mark.parametrize("field", list(BAD))
def test_the_same_mistake_gets_the_same_message_from_both_wires(decoded, field):
    http, grpc = decoded[field]["http"], decoded[field]["grpc"]
    assert field in http.get("error", ""), http
    assert http == grpc


# ------------------------------------------------------------------ the source


def underscored_imports(path: Path) -> list[str]:
    """Names imported from another module that start with `_` (dunders aside), and
    modules whose path has such a part: another module's private helpers."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = node.module or ""
            names = [a.name for a in node.names]
            found += [f"{module}.{n}" for n in names if private(n)]
            if any(private(part) for part in module.split(".")):
                found.append(module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if any(map(private, a.name.split(".")))]
    return found


@pytest.mark.parametrize("module", V2_MODULES)
def test_v2_front_ends_import_no_underscored_name(module):
    assert underscored_imports(module) == []


def test_the_check_sees_an_underscored_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from __future__ import annotations\nfrom bitserve import __version__\n"
        "from a.b import public, _private\nfrom grpc_health.v1._async import X\nimport c._d\n"
    )
    assert underscored_imports(source) == ["a.b._private", "grpc_health.v1._async", "c._d"]


def calls(path: Path) -> dict[str, list[str]]:
    """function name -> the names and attributes it calls (`f(...)`, `x.f(...)`)."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            called = out.setdefault(node.name, [])
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call):
                    func = inner.func
                    called.append(func.attr if isinstance(func, ast.Attribute) else "")
                    if isinstance(func, ast.Name):
                        called[-1] = func.id
    return out


def test_the_v2_token_stream_is_written_once():
    """Only generate.py's stream iterates the engine's `generate`; HTTP's
    generate_stream and gRPC's ModelStreamInfer both call that one `text_stream`."""
    http, grpc = calls(SERVER / "generate.py"), calls(SERVER / "grpc_server.py")
    assert [f for f, called in grpc.items() if "generate" in called] == []
    assert [f for f, called in http.items() if "generate" in called] == ["_pieces"]
    assert "text_stream" in http["generate_stream"]
    assert "text_stream" in grpc["_generate"]
    imported = [
        (node.module, [a.name for a in node.names])
        for node in ast.walk(ast.parse((SERVER / "grpc_server.py").read_text()))
        if isinstance(node, ast.ImportFrom)
    ]
    assert ("bitserve.server.generate", ["text_stream"]) in imported
