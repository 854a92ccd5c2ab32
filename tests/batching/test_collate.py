"""Merging requests into a batch and slicing outputs back."""

from __future__ import annotations

import numpy as np
import pytest

from bitserve.batching.batcher import Request
from bitserve.batching.collate import merge, split
from bitserve.config import ModelConfig

CONFIG = ModelConfig.model_validate(
    {
        "name": "m",
        "backend": "python",
        "max_batch_size": 8,
        "input": [
            {
                "name": "ids",
                "datatype": "INT64",
                "dims": [-1],
                "ragged": True,
                "pad_value": 7,
                "mask": "mask",
            },
            {"name": "x", "datatype": "FP32", "dims": [2]},
        ],
        "output": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    }
)


def req(ids, x):
    return Request(
        {"ids": np.array(ids, dtype=np.int64), "x": np.array(x, np.float32)}, len(ids), 0.0
    )


def test_merge_pads_ragged_inputs_and_builds_the_mask():
    batch = [req([[1, 2, 3]], [[0, 1]]), req([[4], [5]], [[2, 3], [4, 5]])]
    merged = merge(CONFIG, batch)
    np.testing.assert_array_equal(merged["ids"], [[1, 2, 3], [4, 7, 7], [5, 7, 7]])
    np.testing.assert_array_equal(merged["mask"], [[1, 1, 1], [1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(merged["x"], [[0, 1], [2, 3], [4, 5]])


def test_single_request_is_passed_without_a_copy():
    one = req([[1, 2]], [[0, 1]])
    assert merge(CONFIG, [one])["x"] is one.inputs["x"]


def test_split_gives_each_caller_its_rows_as_views():
    batch = [req([[1]], [[0, 1]]), req([[4], [5]], [[2, 3], [4, 5]])]
    out = np.arange(6, dtype=np.float32).reshape(3, 2)
    parts = split(CONFIG, batch, {"y": out})
    np.testing.assert_array_equal(parts[0]["y"], [[0, 1]])
    np.testing.assert_array_equal(parts[1]["y"], [[2, 3], [4, 5]])
    assert np.shares_memory(parts[1]["y"], out)


def test_split_refuses_outputs_of_the_wrong_batch_size():
    batch = [req([[1]], [[0, 1]]), req([[4]], [[2, 3]])]
    with pytest.raises(RuntimeError, match="first dimension must be the batch size 2"):
        split(CONFIG, batch, {"y": np.zeros((3, 2))})
    with pytest.raises(RuntimeError, match="no output 'y'"):
        split(CONFIG, batch, {})


def test_split_converts_torch_and_lists_to_the_declared_dtype():
    torch = pytest.importorskip("torch")
    batch = [req([[1]], [[0, 1]])]
    parts = split(CONFIG, batch, {"y": torch.ones(1, 2, dtype=torch.float64)})
    assert parts[0]["y"].dtype == np.float32
