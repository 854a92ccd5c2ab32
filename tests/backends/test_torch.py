"""The torch backend against the eager modules it was exported from."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from bitserve import kernels
from bitserve.backends.base import LoadError
from bitserve.backends.torch import TorchModel, _to_tensor
from bitserve.config import ModelConfig

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.jit is deprecated
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
]


def make_config(inputs: list[dict], outputs: list[dict], **extra) -> ModelConfig:
    return ModelConfig.model_validate(
        {"name": "m", "backend": "torch", "max_batch_size": 8, "input": inputs}
        | {"output": outputs}
        | extra
    )


FP32_X = [{"name": "x", "datatype": "FP32", "dims": [6]}]
FP32_Y = [{"name": "y", "datatype": "FP32", "dims": [3]}]


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Masked(torch.nn.Module):
    """forward(ids, mask, scale): the mask arrives right after its ragged input."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor):
        vectors = self.table(ids) * mask.unsqueeze(-1).float()
        mean = vectors.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).float()
        return {"ignored": ids, "mean": mean * scale, "count": mask.sum(1)}


def export(module: torch.nn.Module, example: tuple, path: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=64)
    shapes = tuple({0: batch} for _ in example)
    torch.export.save(torch.export.export(module.eval(), example, dynamic_shapes=shapes), path)
    return path


@pytest.fixture(scope="module")
def mlp_pt2(tmp_path_factory) -> tuple[Mlp, Path]:
    torch.manual_seed(0)
    module = Mlp().eval()
    folder = tmp_path_factory.mktemp("mlp") / "1"
    folder.mkdir()
    export(module, (torch.randn(2, 6),), folder / "model.pt2")
    return module, folder


def test_pt2_matches_eager_at_any_batch(mlp_pt2) -> None:
    module, folder = mlp_pt2
    model = TorchModel(make_config(FP32_X, FP32_Y), folder)
    model.load()
    assert model.platform == "torch_export"
    for batch in (1, 7):
        x = np.random.default_rng(batch).normal(size=(batch, 6)).astype(np.float32)
        out = model.predict({"x": x})
        torch.testing.assert_close(out["y"], module(torch.from_numpy(x)))


class Wide(torch.nn.Module):
    """Linears the packed GEMM takes (N % 16 == 0: a; c twice; b without bias) and one
    it leaves to torch (d: N = 5), over a 3-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(20, 32)
        self.c = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 48, bias=False)
        self.d = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.c(self.c(torch.relu(self.a(x))))
        return self.b(h), self.d(h)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_pt2_linears_run_the_packed_gemm_and_match_eager(tmp_path: Path, use_kernels) -> None:
    lib = kernels.get()
    if use_kernels and (lib is None or not lib.lib.bs_packed_vectorised()):
        pytest.skip("the packed GEMM is not vectorised on this CPU, so torch keeps its own")
    torch.manual_seed(2)
    module = Wide().eval()
    export(module, (torch.randn(2, 3, 20),), tmp_path / "model.pt2")
    y_and_z = [
        {"name": "y", "datatype": "FP32", "dims": [3, 48]},
        {"name": "z", "datatype": "FP32", "dims": [3, 5]},
    ]
    config = make_config([{"name": "x", "datatype": "FP32", "dims": [3, 20]}], y_and_z)
    kernels.reset(enabled=None if use_kernels else False)
    try:
        model = TorchModel(config, tmp_path)
        model.load()
    finally:
        kernels.reset()
    params = dict(model.module.named_parameters())
    if use_kernels:
        assert model.packed_linears == 4  # a, c twice, b; not d
        assert "a.weight" not in params and "b.weight" not in params  # the packed copy only
    else:
        assert model.packed_linears == 0 and "a.weight" in params
    assert "d.weight" in params
    for batch in (1, 7, 64):
        x = np.random.default_rng(batch).normal(size=(batch, 3, 20)).astype(np.float32)
        out = model.predict({"x": x})
        y, z = module(torch.from_numpy(x))
        torch.testing.assert_close(out["y"], y)
        torch.testing.assert_close(out["z"], z)


def test_torchscript_matches_eager(tmp_path: Path) -> None:
    torch.manual_seed(1)
    module = Mlp().eval()
    torch.jit.script(module).save(str(tmp_path / "model.pt"))
    model = TorchModel(make_config(FP32_X, FP32_Y), tmp_path)
    model.load()
    assert model.platform == "pytorch_libtorch"
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    torch.testing.assert_close(model.predict({"x": x})["y"], module(torch.from_numpy(x)))


def test_mask_follows_its_ragged_input_and_dict_outputs_map_by_name(tmp_path: Path) -> None:
    torch.manual_seed(2)
    module = Masked().eval()
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    scale = torch.tensor([[2.0], [3.0]])
    export(module, (ids, mask, scale), tmp_path / "model.pt2")
    config = make_config(
        [
            {"name": "ids", "datatype": "INT64", "dims": [-1], "ragged": True, "mask": "mask"},
            {"name": "scale", "datatype": "FP32", "dims": [1]},
        ],
        [
            {"name": "mean", "datatype": "FP32", "dims": [4]},
            {"name": "count", "datatype": "INT64", "dims": []},
        ],
    )
    model = TorchModel(config, tmp_path)
    model.load()
    out = model.predict({"ids": ids.numpy(), "mask": mask.numpy(), "scale": scale.numpy()})
    expected = module(ids, mask, scale)
    assert list(out) == ["mean", "count"]
    torch.testing.assert_close(out["mean"], expected["mean"])
    torch.testing.assert_close(out["count"], torch.tensor([3, 1]))


def test_bf16_input_and_tuple_outputs(tmp_path: Path) -> None:
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor):
            return x.float() * 2, x.sum(-1, keepdim=True)

    export(Pair(), (torch.ones(2, 6, dtype=torch.bfloat16),), tmp_path / "model.pt2")
    outputs = [
        {"name": "double", "datatype": "FP32", "dims": [6]},
        {"name": "total", "datatype": "BF16", "dims": [1]},
    ]
    config = make_config([{"name": "x", "datatype": "BF16", "dims": [6]}], outputs)
    model = TorchModel(config, tmp_path)
    model.load()
    x = np.arange(12, dtype=np.float32).reshape(2, 6).astype(ml_dtypes.bfloat16)
    out = model.predict({"x": x})
    reference = torch.arange(12, dtype=torch.float32).reshape(2, 6).to(torch.bfloat16)
    torch.testing.assert_close(out["double"], reference.float() * 2)
    assert out["total"].dtype == torch.bfloat16
    torch.testing.assert_close(out["total"], reference.sum(-1, keepdim=True))

    too_many = make_config(config.model_dump()["input"], outputs[:1])
    model = TorchModel(too_many, tmp_path)
    model.load()
    with pytest.raises(ValueError, match="returned 2 outputs"):
        model.predict({"x": x})


def test_inputs_are_not_copied() -> None:
    x = np.zeros((3, 4), dtype=np.float32)
    assert _to_tensor(x).data_ptr() == x.ctypes.data
    b = np.zeros((3, 4), dtype=ml_dtypes.bfloat16)
    tensor = _to_tensor(b)
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == b.ctypes.data
    read_only = np.frombuffer(bytes(16), dtype=np.float32)  # as the binary protocol decodes
    assert _to_tensor(read_only).data_ptr() == read_only.ctypes.data
    reversed_view = np.arange(4, dtype=np.float32)[::-1]
    torch.testing.assert_close(_to_tensor(reversed_view), torch.tensor([3.0, 2.0, 1.0, 0.0]))


def test_threads_come_from_the_instance_group(mlp_pt2) -> None:
    config = make_config(FP32_X, FP32_Y, instance_group={"threads": 2})
    try:
        TorchModel(config, mlp_pt2[1]).load()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    config = make_config(FP32_X, FP32_Y)
    with pytest.raises(LoadError, match=r"no model\.pt2 or model\.pt"):
        TorchModel(config, tmp_path).load()
    (tmp_path / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(LoadError, match=str(tmp_path / "model.pt2")):
        TorchModel(config, tmp_path).load()
    (tmp_path / "model.pt2").unlink()
    (tmp_path / "model.pt").write_bytes(b"garbage")
    with pytest.raises(LoadError, match=str(tmp_path / "model.pt")):
        TorchModel(config, tmp_path).load()
    text = make_config([{"name": "x", "datatype": "BYTES", "dims": [1]}], FP32_Y)
    with pytest.raises(LoadError, match="BYTES"):
        TorchModel(text, tmp_path).load()


class Boom:
    """A pickle that would create a folder when unpickled: the proof of code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def rewrite(source: Path, target: Path, change) -> Path:
    """Copy a .pt2 archive, passing each (entry, bytes) through `change` (None drops it)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            entry = info.filename.split("/", 1)[1]
            data = change(entry, old.read(info.filename))
            if data is not None:
                new.writestr(info, data)
    return target


def flag_pickle(entry: str, data: bytes) -> bytes:
    if entry.endswith("_weights_config.json"):
        config = json.loads(data)
        for meta in config["config"].values():
            meta["use_pickle"] = True
        return json.dumps(config).encode()
    return data


@pytest.mark.parametrize(
    "change, reason",
    [
        (flag_pickle, "pickle"),
        (lambda e, d: None if e == "archive_version" else d, "old torch.export layout"),
        (lambda e, d: d if e != "data/weights/weight_0" else None, None),  # torch's own error
    ],
)
def test_pt2_that_would_unpickle_is_refused(mlp_pt2, tmp_path: Path, change, reason) -> None:
    (tmp_path / "1").mkdir()
    rewrite(mlp_pt2[1] / "model.pt2", tmp_path / "1" / "model.pt2", change)
    with pytest.raises(LoadError, match=reason or "model.pt2"):
        TorchModel(make_config(FP32_X, FP32_Y), tmp_path / "1").load()


def plant(case: str, evil: bytes):
    """An archive change that makes `torch.export.load` run the pickle `evil`."""

    def change(entry: str, data: bytes) -> bytes | None:
        if case == "sample_inputs" and entry.startswith("data/sample_inputs/"):
            return evil  # torch tries weights_only=True, then retries unrestricted
        if case == "opaque_constant" and entry.endswith("_constants_config.json"):
            meta = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True}
            return json.dumps({"config": {"c": meta | {"tensor_meta": None}}}).encode()
        if case == "legacy_weights" and entry.endswith("_weights_config.json"):
            return None  # torch then reads data/weights/model.pt with the same retry
        return data

    extra = {
        "opaque_constant": "data/constants/opaque_obj_0",
        "legacy_weights": "data/weights/model.pt",
    }
    return change, extra.get(case)


@pytest.mark.parametrize("case", ["sample_inputs", "opaque_constant", "legacy_weights"])
def test_malicious_pickles_never_run(mlp_pt2, tmp_path: Path, case: str) -> None:
    marker = tmp_path / "pwned"
    change, extra = plant(case, pickle.dumps(Boom(marker)))
    path = rewrite(mlp_pt2[1] / "model.pt2", tmp_path / "model.pt2", change)
    if extra:
        with zipfile.ZipFile(path, "a") as archive:
            root = archive.namelist()[0].split("/")[0]
            archive.writestr(f"{root}/{extra}", pickle.dumps(Boom(marker)))
    with pytest.raises(LoadError, match=r"pickle|refusing"):
        TorchModel(make_config(FP32_X, FP32_Y), tmp_path).load()
    assert not marker.exists()
