"""The training loop and the student's distillation loss, on tiny networks (seconds)."""

import numpy as np
import pytest
import torch

from bitserve.vision import net, train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def teacher() -> net.CenterNet:
    torch.manual_seed(0)
    return net.CenterNet((8, 16, 16, 16)).eval()


def test_teacher_graph_computes_what_torch_does(teacher):
    x = torch.rand(2, 1, 96, 96)
    logits, reg, feature = train.Distillation(teacher, 8).teacher(x)
    with torch.no_grad():
        expected = teacher.features(x)
        assert torch.allclose(feature, expected, atol=1e-4)
        for got, want in zip((logits, reg), teacher.heads(expected), strict=True):
            assert torch.allclose(got, want, atol=1e-4)


def test_distillation_trains_the_adapter_and_hands_back_a_plain_layout(teacher):
    student = net.CenterNet((4, 8, 8, 8))
    loss = train.Distillation(teacher, student.widths[3])
    before = loss.adapter.weight.detach().clone()
    config = train.TrainConfig(steps=2, batch=2, resolutions=(64,), log_every=1)
    minutes = train.train(student, config, loss, log=lambda line: None)
    assert minutes > 0
    assert not torch.equal(loss.adapter.weight, before)  # the adapter learns with the student
    assert all(p.is_contiguous() for p in student.parameters())  # exportable, savable as is
    assert not student.training


def test_a_student_that_is_the_teacher_pays_only_the_ground_truth_loss(teacher):
    """Soft targets, regression and features all agree (identity adapter): only the hard
    loss is left, so each distillation term is zero where the student matches."""
    loss = train.Distillation(teacher, teacher.widths[3])
    with torch.no_grad():
        loss.adapter.weight.copy_(torch.eye(16)[..., None, None])
        loss.adapter.bias.zero_()
        batch = train.batch_tensors(np.random.default_rng(0), 2, 64)
        hard = net.detection_loss(teacher, *batch)
        total = loss(teacher, *batch)
    assert total.item() == pytest.approx(hard.item(), abs=1e-3)
