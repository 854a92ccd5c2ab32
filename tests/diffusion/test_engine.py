"""The step loop: per-row timesteps and scales in one forward, joins and leaves at the
next step, and images that do not depend on what they were batched with."""

import threading

import pytest
import torch

from bitserve.diffusion.engine import Cancelled, DiffusionEngine, EngineStopped, Overloaded
from bitserve.diffusion.params import GenerationParams as P
from tests.diffusion.conftest import run


def test_an_image_is_the_same_alone_and_batched_with_15_others(engine):
    alone = engine.submit(P(label=7, guidance_scale=3.0, steps=30, seed=11))
    run(engine)
    # 15 others, at other timesteps (they start earlier, with other step counts) and
    # other scales, DDIM and DDPM; the same request joins them mid-way
    others = [
        engine.submit(P(label=i % 10, guidance_scale=[0, 1, 2, 3, 5][i % 5], steps=20 + 3 * i,
                        seed=100 + i, eta=[0.0, 1.0, 0.5][i % 3]))
        for i in range(15)
    ]  # fmt: skip
    for _ in range(7):
        engine.step()
    batched = engine.submit(P(label=7, guidance_scale=3.0, steps=30, seed=11))
    sizes = []
    while size := engine.step():
        sizes.append(size)
    assert sizes[0] == 16  # it really ran batched: with all 15 others at once
    diff = (alone.future.result() - batched.future.result()).abs().max().item()
    assert diff <= 1e-5
    assert all(o.future.done() and o.future.exception() is None for o in others)


def test_a_request_joins_at_the_next_step(engine):
    a = engine.submit(P(label=1, steps=10, seed=1))
    for _ in range(3):
        engine.step()
    b = engine.submit(P(label=2, steps=10, seed=2))
    assert engine.step() == 2  # b is in the very next step, at its own first timestep
    assert (a.index, b.index) == (4, 1)
    assert a.timesteps[3] != b.timesteps[0]


def test_a_cancelled_request_leaves_at_the_next_step_and_frees_its_slot(denoiser):
    model, schedule = denoiser
    engine = DiffusionEngine(model, schedule, max_rows=2)
    a, b, c = (engine.submit(P(label=i, steps=20, seed=i)) for i in range(3))
    engine.step()
    assert {r.state for r in (a, b)} == {"running"} and c.state == "waiting"
    engine.cancel(a)
    assert engine.step() == 2  # a left; c took its slot in the same step
    assert a.index == 1 and c.index == 1 and b.index == 2
    with pytest.raises(Cancelled):
        a.future.result(timeout=0)
    assert engine.stats.cancelled == 1
    run(engine)
    assert b.future.result().shape == (16, 16) and c.future.result().shape == (16, 16)


def test_unguided_rows_skip_the_unconditional_half(engine):
    engine.submit(P(label=3, guidance_scale=1.0, steps=5, seed=0))  # eps_c only
    engine.submit(P(label=3, guidance_scale=0.0, steps=5, seed=0))  # eps_u only
    engine.submit(P(label=None, guidance_scale=4.0, steps=5, seed=0))  # null label
    run(engine)
    assert engine.stats.uncond_rows == 0
    engine.submit(P(label=3, guidance_scale=3.0, steps=5, seed=0))
    run(engine)
    assert engine.stats.uncond_rows == 5


def test_guidance_scale_zero_is_the_unconditional_model(engine):
    uncond = engine.submit(P(label=3, guidance_scale=0.0, steps=8, seed=5))
    null = engine.submit(P(label=None, guidance_scale=3.0, steps=8, seed=5))
    run(engine)
    assert torch.equal(uncond.future.result(), null.future.result())


def test_one_batched_cfg_pass_equals_two_separate_passes(denoiser):
    model, _ = denoiser
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 16, 16, generator=g)
    t = torch.tensor([999, 700, 500, 300, 100, 3])
    label = torch.tensor([0, 1, 2, 3, 4, 5])
    both = torch.tensor([True, False, True, True, False, True])
    with torch.inference_mode():
        eps_c, eps_u = model.guided(x, t, label, both)
        cond = model(x, t, label)
        null = model(x[both], t[both], torch.full((4,), model.config.null_label))
    assert (eps_c - cond).abs().max() <= 1e-5
    assert (eps_u - null).abs().max() <= 1e-5


def test_same_seed_same_image_and_ddpm_differs_from_ddim(engine):
    rows = [engine.submit(P(label=4, steps=12, seed=s, eta=e)) for s, e in
            [(9, 0.0), (9, 0.0), (9, 1.0), (9, 1.0), (10, 0.0)]]  # fmt: skip
    run(engine)
    out = [r.future.result() for r in rows]
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3])
    assert (out[0] - out[2]).abs().max() > 0.05  # ancestral noise changes the path
    assert (out[0] - out[4]).abs().max() > 0.05
    assert all(o.min() >= 0 and o.max() <= 1 for o in out)


def test_a_failing_step_fails_its_rows_not_the_engine(engine, monkeypatch):
    row = engine.submit(P(label=1, steps=5, seed=1))
    guided = engine.model.guided

    def broken(*args):
        monkeypatch.setattr(engine.model, "guided", guided)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.model, "guided", broken)
    engine.step()
    with pytest.raises(RuntimeError, match="denoising step failed"):
        row.future.result(timeout=0)
    again = engine.submit(P(label=1, steps=5, seed=1))
    run(engine)
    assert again.future.result().shape == (16, 16)
    assert engine.stats.failed == 1


def test_the_engine_thread_serves_threads_and_stops_cleanly(denoiser):
    model, schedule = denoiser
    engine = DiffusionEngine(model, schedule, max_waiting=4).start()
    results = {}

    def client(i):
        results[i] = engine.submit(P(label=i, steps=6, seed=i)).future.result(timeout=30)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and engine.stats.images == 4
    assert engine.stats.rows.total / engine.stats.steps > 1  # they shared steps
    engine.stop()  # not started rows would fail; a submit now is refused
    with pytest.raises(EngineStopped):
        engine.submit(P(label=1))


def test_a_full_queue_is_refused(denoiser):
    model, schedule = denoiser
    engine = DiffusionEngine(model, schedule, max_waiting=2)
    engine.submit(P(label=1))
    engine.submit(P(label=2))
    with pytest.raises(Overloaded):
        engine.submit(P(label=3))


def test_a_request_cancelled_during_a_step_ends_at_the_next(engine, monkeypatch):
    row = engine.submit(P(label=1, steps=10, seed=1))
    guided = engine.model.guided

    def cancel_meanwhile(*args):
        engine.cancel(row)  # as the event loop would, while the step runs
        return guided(*args)

    monkeypatch.setattr(engine.model, "guided", cancel_meanwhile)
    assert engine.step() == 1
    monkeypatch.setattr(engine.model, "guided", guided)
    assert engine.step() == 0
    with pytest.raises(Cancelled):
        row.future.result(timeout=0)
    assert engine.stats.cancelled == 1 and not engine.running
