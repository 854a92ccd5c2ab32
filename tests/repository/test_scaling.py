"""Ray Serve's autoscaling rule, the one copy both kinds of Ray replicas use."""

from bitserve.config import Autoscaling
from bitserve.repository.scaling import ScalingRule


def rule(**kw) -> ScalingRule:
    base = dict(
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=2,
        upscale_delay_s=30,
        downscale_delay_s=600,
    )
    return ScalingRule(Autoscaling(**(base | kw)))


def test_wanted_is_ongoing_over_target_clamped():
    r = rule()
    assert [r.wanted(n) for n in (0, 1, 2, 3, 8, 9, 100)] == [1, 1, 1, 2, 4, 4, 4]
    assert rule(min_replicas=0).wanted(0) == 0


def test_a_change_waits_out_its_delay_held_at_the_same_count():
    r = rule()
    assert r.change(8, 1, now=0) == 0  # wants 4: starts the clock
    assert r.change(8, 1, now=29.9) == 0
    assert r.change(6, 1, now=30) == 0  # wants 3 now: a different count restarts it
    assert r.change(6, 1, now=59.9) == 0
    assert r.change(6, 1, now=60) == 2
    assert r.change(6, 3, now=60.1) == 0  # at the count: nothing, the clock cleared
    assert r.change(0, 3, now=61) == 0
    assert r.change(0, 3, now=660.9) == 0
    assert r.change(0, 3, now=661) == -2


def test_a_need_that_goes_away_resets_the_clock():
    r = rule()
    assert r.change(8, 1, now=0) == 0
    assert r.change(2, 1, now=20) == 0  # back to one: the need is gone
    assert r.change(8, 1, now=31) == 0  # a new need waits its own delay
    assert r.change(8, 1, now=61) == 3


def test_from_zero_the_delay_is_not_waited():
    r = rule(min_replicas=0)
    assert r.change(1, 0, now=0) == 1
    assert r.change(0, 1, now=1) == 0
    assert r.change(0, 1, now=601) == -1
