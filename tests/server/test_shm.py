"""Triton's system shared-memory extension (bitserve/server/shm.py) through tritonclient's
own helpers, unmodified: `tritonclient.utils.shared_memory` creates and fills the regions,
tritonclient.http and tritonclient.grpc register them, infer with inputs and outputs in
them, read the status and unregister. The reference is the same request sent plainly
over HTTP. Regions that do not fit are 400s naming the field; CUDA regions are refused."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tests.conftest import Server, write_model

TOKEN = "shm-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
CONFIG = """
backend = "python"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [3]
[[input]]
name = "k"
datatype = "INT32"
dims = [1]
[[output]]
name = "y"
datatype = "FP32"
dims = [3]
[[output]]
name = "t"
datatype = "BYTES"
dims = [1]
[dynamic_batching]
max_queue_delay_ms = 1
"""
CODE = """
import numpy as np

class Model:
    def predict(self, inputs):
        x, k = inputs["x"], inputs["k"]
        text = np.array([[f"sum {s:.3f}".encode()] for s in x.sum(axis=1)], dtype=object)
        return {"y": 2 * x + k, "t": text}
"""
X = np.array([[1.5, -2.0, 3.25], [0.0, 4.0, -1.0]], dtype=np.float32)
K = np.array([[3], [-7]], dtype=np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("shm") / "models"
    write_model(repo, "affine", CONFIG, CODE)
    from tests.conftest import free_port

    port = free_port()
    server = Server(repo, "--grpc-port", str(port), "--admin-token", TOKEN)
    server.grpc = f"127.0.0.1:{port}"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    return th.InferenceServerClient(server.url.removeprefix("http://"))


@pytest.fixture(scope="module")
def grpc_client(server):
    return tg.InferenceServerClient(server.grpc)


@pytest.fixture(scope="module")
def plain(http):
    """The reference: the same request with its data in the body."""
    given = [th.InferInput("x", list(X.shape), "FP32"), th.InferInput("k", list(K.shape), "INT32")]
    given[0].set_data_from_numpy(X)
    given[1].set_data_from_numpy(K)
    result = http.infer("affine", given)
    return {"y": result.as_numpy("y"), "t": result.as_numpy("t")}


@pytest.fixture
def regions(request):
    """An input region holding x then k (k at an offset) and an output region; each
    test's own keys, destroyed after."""
    tag = request.node.name.replace("[", "_").replace("]", "")
    made = []

    def make(name: str, size: int):
        handle = shm.create_shared_memory_region(name, f"/bitserve-test-{tag}-{name}", size)
        made.append(handle)
        return handle

    inputs = make("in", X.nbytes + 64 + K.nbytes)
    shm.set_shared_memory_region(inputs, [X])
    shm.set_shared_memory_region(inputs, [K], offset=X.nbytes + 64)
    outputs = make("out", 4096)
    yield inputs, outputs
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _key(handle) -> str:
    return handle._shm_key


def _infer_in_shm(module, client, out_size: int = 4096, offset: int = 0):
    x = module.InferInput("x", list(X.shape), "FP32")
    x.set_shared_memory("in", X.nbytes)
    k = module.InferInput("k", list(K.shape), "INT32")
    k.set_shared_memory("in", K.nbytes, offset=X.nbytes + 64 + offset)
    y = module.InferRequestedOutput("y")
    y.set_shared_memory("out", out_size // 2)
    t = module.InferRequestedOutput("t")
    t.set_shared_memory("out", out_size // 2, offset=out_size // 2)
    return client.infer("affine", [x, k], outputs=[y, t])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory_equal_plain_http(
    protocol, http, grpc_client, plain, regions
):
    module, client = (th, http) if protocol == "http" else (tg, grpc_client)
    inputs, outputs = regions
    client.register_system_shared_memory(
        "in", _key(inputs), X.nbytes + 64 + K.nbytes, headers=ADMIN
    )
    client.register_system_shared_memory("out", _key(outputs), 4096, headers=ADMIN)
    status = client.get_system_shared_memory_status(headers=ADMIN)
    if protocol == "http":
        assert sorted(r["name"] for r in status) == ["in", "out"]
    else:
        assert sorted(status.regions) == ["in", "out"]
        assert status.regions["out"].byte_size == 4096

    result = _infer_in_shm(module, client)
    y_out = result.get_output("y")
    if protocol == "http":
        y_size = y_out["parameters"]["shared_memory_byte_size"]
        assert "data" not in y_out and y_out["parameters"]["shared_memory_region"] == "out"
    else:
        y_size = y_out.parameters["shared_memory_byte_size"].int64_param
        assert y_out.parameters["shared_memory_region"].string_param == "out"
    assert y_size == X.nbytes
    y = shm.get_contents_as_numpy(outputs, np.float32, list(X.shape))
    t = shm.get_contents_as_numpy(outputs, np.object_, [2, 1], offset=2048)
    np.testing.assert_array_equal(y, plain["y"])
    np.testing.assert_array_equal(t, plain["t"])

    client.unregister_system_shared_memory("in", headers=ADMIN)
    remaining = client.get_system_shared_memory_status(headers=ADMIN)
    assert len(remaining if protocol == "http" else remaining.regions) == 1
    client.unregister_system_shared_memory(headers=ADMIN)  # all
    remaining = client.get_system_shared_memory_status(headers=ADMIN)
    assert len(remaining if protocol == "http" else remaining.regions) == 0


def _status_of(error: InferenceServerException) -> str:
    return str(error.status())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_regions_that_do_not_fit_are_400s_naming_the_field(
    protocol, http, grpc_client, regions, server
):
    module, client = (th, http) if protocol == "http" else (tg, grpc_client)
    bad = "400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"
    inputs, outputs = regions
    size = X.nbytes + 64 + K.nbytes
    with pytest.raises(InferenceServerException, match="byte_size") as e:  # bigger than the object
        client.register_system_shared_memory("in", _key(inputs), size + 1, headers=ADMIN)
    assert _status_of(e.value) == bad
    with pytest.raises(InferenceServerException, match="key") as e:
        client.register_system_shared_memory("in", "/no-such-object-here", 8, headers=ADMIN)
    assert _status_of(e.value) == bad
    client.register_system_shared_memory("in", _key(inputs), size, headers=ADMIN)
    client.register_system_shared_memory("out", _key(outputs), 64, headers=ADMIN)  # too small
    try:
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory("in", _key(inputs), size, headers=ADMIN)
        with pytest.raises(InferenceServerException, match=r"input 'k'.*exceeds region 'in'") as e:
            _infer_in_shm(module, client, out_size=64, offset=1)  # k's offset one past the end
        assert _status_of(e.value) == bad
        with pytest.raises(InferenceServerException, match=r"'y'.*exceeds region 'out'") as e:
            _infer_in_shm(module, client, out_size=4096)  # windows beyond the 64 registered
        assert _status_of(e.value) == bad
        with pytest.raises(InferenceServerException, match="output 'y': 24 bytes do not fit") as e:
            _infer_in_shm(module, client, out_size=32)  # fits the region, not the tensor
        assert _status_of(e.value) == bad
        x = module.InferInput("x", list(X.shape), "FP32")
        x.set_shared_memory("nowhere", X.nbytes)
        k = module.InferInput("k", list(K.shape), "INT32")
        k.set_data_from_numpy(K)
        with pytest.raises(InferenceServerException, match="no shared memory region 'nowhere'"):
            client.infer("affine", [x, k])
    finally:
        client.unregister_system_shared_memory(headers=ADMIN)
    assert server.alive()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_managing_regions_needs_the_admin_token(protocol, http, grpc_client, regions):
    client = http if protocol == "http" else grpc_client
    with pytest.raises(InferenceServerException, match="admin token"):
        client.register_system_shared_memory("in", _key(regions[0]), 8)
    with pytest.raises(InferenceServerException, match="admin token"):
        client.get_system_shared_memory_status()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_shared_memory_is_refused_on_a_cpu_instance(protocol, http, grpc_client):
    client = http if protocol == "http" else grpc_client
    handle = serialize_byte_tensor(np.array([b"not a cudaIpcMemHandle"], dtype=object)).item()
    with pytest.raises(InferenceServerException, match="CUDA shared memory needs a GPU") as e:
        client.register_cuda_shared_memory("gpu", handle, 0, 1024, headers=ADMIN)
    assert _status_of(e.value) == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    status = client.get_cuda_shared_memory_status(headers=ADMIN)
    assert len(status if protocol == "http" else status.regions) == 0
