"""A version's fixed window of latest requests."""

from __future__ import annotations

import numpy as np

from bitserve.rollout.window import Window


def test_window_counts_errors_as_samples_enter_and_leave():
    window = Window(100)
    rng = np.random.default_rng(8)
    for ok in rng.random(1000) > 0.1:
        window.add(0.01, bool(ok))
        assert window.window_errors() == sum(not o for _, o in window.samples)
    assert (window.requests, len(window)) == (1000, 100)
    window.resize(50)
    assert len(window) == 50
    assert window.window_errors() == sum(not o for _, o in window.samples)
