"""Grammar masks on the logits: bits unpacked as numpy reads them, rows picked as asked,
and everything on the logits' device (checked on `meta` by a mode that refuses any op
mixing devices: `meta` alone lets a CPU index into index_select pass)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bitserve.llm.structured import apply_masks, unpack

MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class OneDevice(TorchDispatchMode):
    """Every op's tensors on one device (0-dim CPU scalars aside, as torch allows); only
    explicit moves (`.to`, `copy_`) may cross."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in MOVES:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if t.dim() > 0 or t.device.type != "cpu"}
            if len(devices) > 1:
                raise AssertionError(f"{func} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def random_bitmask(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).int()


def test_unpack_reads_bits_as_numpy_does():
    bitmask = random_bitmask(3, 100)
    bits = np.unpackbits(bitmask.numpy().astype("<i4").view(np.uint8), bitorder="little")
    expected = torch.from_numpy(bits.reshape(3, -1)[:, :100].astype(bool))
    assert torch.equal(unpack(bitmask, 100), expected)


def test_apply_masks_sets_refused_tokens_of_the_asked_rows():
    vocab = 70
    logits = torch.randn(5, vocab)
    before = logits.clone()
    bitmask = random_bitmask(3, vocab, seed=1)
    apply_masks(logits, [4, 1], bitmask, [2, 0])  # row 4 by mask row 2, row 1 by mask row 0
    allowed = unpack(bitmask, vocab)
    for row, mask_row in ((4, 2), (1, 0)):
        want = torch.where(allowed[mask_row], before[row], float("-inf"))
        assert torch.equal(logits[row], want)
    for row in (0, 2, 3):
        assert torch.equal(logits[row], before[row])
    in_order = before.clone()
    apply_masks(in_order, [0, 3, 2], bitmask)  # default: mask rows in order
    assert torch.equal(in_order[3], torch.where(allowed[1], before[3], float("-inf")))


@pytest.mark.parametrize("picks", [None, [1, 0]])
def test_apply_masks_stays_on_the_logits_device(picks):
    logits = torch.empty(4, 70, device="meta")
    with OneDevice():
        apply_masks(logits, [3, 1], random_bitmask(2, 70), picks)  # the bitmask: CPU


def test_one_device_refuses_a_cpu_index_on_meta():
    """The guard itself: what meta alone lets through (gpu-device.md), it refuses."""
    with OneDevice(), pytest.raises(AssertionError, match="mixes devices"):
        torch.empty(4, 70, device="meta").index_select(0, torch.tensor([1, 2]))
