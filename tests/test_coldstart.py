"""The cold-start breakdown: wall-clock phases that add up even when models overlap."""

from __future__ import annotations

import pytest

from bitserve import coldstart


def test_parallel_loads_count_once_and_the_phases_sum_to_the_total():
    # process start 0, bitserve imported at 1, heavy libraries take 1 more (until 2);
    # model A loads 2-5 and warms 5-6, model B loads 3-4 and warms 4-7; ready at 8.
    a_load, a_warm = coldstart.spans(6.0, 3.0, 1.0)
    b_load, b_warm = coldstart.spans(7.0, 1.0, 3.0)
    assert (a_load, a_warm) == ((2.0, 5.0), (5.0, 6.0))
    startup = coldstart.breakdown(
        0.0, 1.0, 8.0, loads=[a_load, b_load], warmups=[a_warm, b_warm], preimport=1.0
    )
    # load: 2-5 (union); warmup: 4-7 minus the load time 4-5 = 5-7; other: 7-8
    assert startup.phases() == pytest.approx(
        {"import": 2.0, "load": 3.0, "warmup": 2.0, "other": 1.0, "total": 8.0}
    )


def test_spans_outside_the_loading_window_are_clipped():
    startup = coldstart.breakdown(0.0, 1.0, 4.0, loads=[(0.5, 3.0)], warmups=[(3.0, 9.0)])
    assert startup.phases() == pytest.approx(
        {"import": 1.0, "load": 2.0, "warmup": 1.0, "other": 0.0, "total": 4.0}
    )
