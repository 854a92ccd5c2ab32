"""The batcher driven by a manual clock: exact batch sizes and waiting times, no sleeps."""

from __future__ import annotations

import pytest

from bitserve.batching.batcher import DynamicBatcher, QueueFull, QueueTimeout, Request
from bitserve.batching.clock import ManualClock
from bitserve.config import DynamicBatching

MS = 1e-3


class Harness:
    """A batcher whose instances record what they were given and finish on demand."""

    def __init__(self, max_batch_size=8, instances=1, **policy):
        self.clock = ManualClock()
        self.batches: list[tuple[float, int, list[Request]]] = []
        self.results: dict[str, object] = {}
        batching = None if policy.pop("unbatched", False) else DynamicBatching(**policy)
        self.batcher = DynamicBatcher(
            "m", max_batch_size, batching, instances, self._execute, self.clock
        )

    def _execute(self, slot, batch):
        self.batches.append((self.clock.now(), slot, batch))

    def submit(self, tag, rows=1, priority=1, timeout=None, shape=()):
        def done(out, err, tag=tag):
            self.results[tag] = err if err is not None else out

        request = Request(
            {"tag": tag},
            rows,
            self.clock.now(),
            priority=priority,
            timeout_at=None if timeout is None else self.clock.now() + timeout,
            shape_key=shape,
            on_done=done,
        )
        self.batcher.submit(request)
        return request

    def finish(self, index=0):
        """Complete the index-th batch still running and free its instance."""
        _, slot, batch = self.running.pop(index)
        for request in batch:
            request.finish("ok")
        self.batcher.release(slot)

    @property
    def running(self):
        if not hasattr(self, "_running"):
            self._running = []
        # Everything dispatched and not finished yet, in dispatch order.
        seen = {id(b) for _, _, b in self._running}
        self._running += [x for x in self.batches if id(x[2]) not in seen and not _done(x[2])]
        return self._running

    def tags(self, i):
        return [r.inputs["tag"] for r in self.batches[i][2]]

    def waits(self, i):
        """How long each request of batch i waited, in ms."""
        at = self.batches[i][0]
        return [round((at - r.arrival) / MS, 6) for r in self.batches[i][2]]


def _done(batch):
    return all(r.state == "done" for r in batch)


def test_full_batch_leaves_at_once():
    h = Harness(max_batch_size=4, max_queue_delay_ms=100, dispatch_when_idle=False)
    for t in "abcd":
        h.submit(t)
    assert len(h.batches) == 1 and h.tags(0) == list("abcd")
    assert h.batches[0][0] == 0.0


def test_delay_counts_from_the_oldest_arrival():
    h = Harness(max_batch_size=8, max_queue_delay_ms=10, dispatch_when_idle=False)
    h.submit("a")
    h.clock.advance(1 * MS)
    h.submit("b")
    h.clock.advance(2 * MS)
    h.submit("c")
    assert h.batches == []
    assert h.clock.pending() == [pytest.approx(10 * MS)]
    h.clock.advance_to(9.999 * MS)
    assert h.batches == []
    h.clock.advance_to(10 * MS)
    assert h.tags(0) == ["a", "b", "c"]
    assert h.waits(0) == [10.0, 9.0, 7.0]


def test_idle_instance_takes_a_lone_request_without_waiting():
    h = Harness(max_batch_size=8, max_queue_delay_ms=10)
    h.submit("a")
    assert h.tags(0) == ["a"] and h.waits(0) == [0.0]
    # While "a" runs, b, c, d queue; when the instance frees at 4 ms, the oldest (b,
    # arrived at 1 ms) has waited 3 ms of its 10: the batch leaves at 11 ms.
    for t in "bcd":
        h.clock.advance(1 * MS)
        h.submit(t)
    h.clock.advance(1 * MS)
    h.finish()
    assert len(h.batches) == 1
    h.clock.advance(7 * MS)
    assert h.tags(1) == ["b", "c", "d"]
    assert h.waits(1) == [10.0, 9.0, 8.0]


def test_busy_instance_then_delay_already_spent_sends_immediately():
    h = Harness(max_batch_size=8, max_queue_delay_ms=2)
    h.submit("a")
    h.submit("b")
    h.submit("c")
    h.clock.advance(5 * MS)
    h.finish()
    assert h.tags(1) == ["b", "c"] and h.waits(1) == [5.0, 5.0]


def test_largest_preferred_size_that_can_be_formed():
    h = Harness(max_batch_size=8, max_queue_delay_ms=50, preferred_batch_sizes=[2, 4])
    h.submit("busy")
    for t in "abcde":
        h.submit(t)
    h.finish()
    assert h.tags(1) == ["a", "b", "c", "d"]  # 5 queued: the largest preferred is 4
    h.finish()
    assert len(h.batches) == 2  # one left: below every preferred size, so it waits
    h.clock.advance(50 * MS)
    assert h.tags(2) == ["e"] and h.waits(2) == [50.0]


def test_max_batch_size_caps_a_long_queue():
    h = Harness(max_batch_size=3, max_queue_delay_ms=0)
    h.submit("busy")
    for t in "abcdefg":
        h.submit(t)
    h.finish()
    assert h.tags(1) == ["a", "b", "c"]
    h.finish()
    assert h.tags(2) == ["d", "e", "f"]
    h.finish()
    assert h.tags(3) == ["g"]


def test_rows_not_requests_fill_a_batch():
    h = Harness(max_batch_size=4, max_queue_delay_ms=0)
    h.submit("busy")
    h.submit("a", rows=3)
    h.submit("b", rows=2)
    h.submit("c", rows=1)
    h.finish()
    assert h.tags(1) == ["a"]  # b does not fit beside a; FIFO keeps c behind b
    h.finish()
    assert h.tags(2) == ["b", "c"]


def test_stats_count_rows_and_executions():
    h = Harness(max_batch_size=4, max_queue_delay_ms=0)
    h.submit("busy")
    h.submit("a", rows=3)
    h.submit("b", rows=2)
    h.finish()
    h.finish()
    stats = h.batcher.stats
    assert (stats.inference_count, stats.execution_count) == (6, 3)
    assert stats.batch_sizes == {1: 1, 3: 1, 2: 1}


def test_different_shapes_never_share_a_batch():
    h = Harness(max_batch_size=8, max_queue_delay_ms=0)
    h.submit("busy")
    h.submit("a", shape=(("x", (3,)),))
    h.submit("b", shape=(("x", (3,)),))
    h.submit("c", shape=(("x", (5,)),))
    h.finish()
    assert h.tags(1) == ["a", "b"]
    h.finish()
    assert h.tags(2) == ["c"]


def test_priority_levels_highest_first_fifo_within():
    h = Harness(max_batch_size=2, max_queue_delay_ms=0, priority_levels=3)
    h.submit("busy")
    h.submit("low1", priority=3)
    h.submit("mid1", priority=2)
    h.submit("low2", priority=3)
    h.submit("high1", priority=1)
    h.submit("mid2", priority=2)
    for _ in range(3):
        h.finish()
    assert [h.tags(i) for i in (1, 2, 3)] == [
        ["high1", "mid1"],
        ["mid2", "low1"],
        ["low2"],
    ]


def test_timeout_in_queue_rejects_and_never_runs():
    h = Harness(max_batch_size=4, max_queue_delay_ms=0)
    h.submit("busy")
    h.submit("a", timeout=5 * MS)
    h.submit("b", timeout=20 * MS)
    h.clock.advance(5 * MS)
    assert isinstance(h.results["a"], QueueTimeout)
    assert "b" not in h.results
    h.finish()
    assert h.tags(1) == ["b"]
    assert all("a" not in h.tags(i) for i in range(len(h.batches)))
    assert h.batcher.stats.rejected_timeout == 1


def test_full_queue_rejects_at_once_with_retry_after():
    h = Harness(max_batch_size=4, max_queue_delay_ms=10, max_queue_size=2)
    h.submit("busy")
    h.submit("a")
    h.submit("b")
    with pytest.raises(QueueFull) as info:
        h.submit("c")
    assert info.value.retry_after >= 1
    assert h.batcher.queued == 2 and h.batcher.stats.rejected_full == 1


def test_cancelled_request_leaves_the_queue():
    h = Harness(max_batch_size=4, max_queue_delay_ms=0)
    h.submit("busy")
    a = h.submit("a")
    h.submit("b")
    assert h.batcher.cancel(a) is True
    h.finish()
    assert h.tags(1) == ["b"]
    assert h.batcher.cancel(a) is False
    assert h.batcher.stats.cancelled == 1


def test_running_request_cannot_be_cancelled():
    h = Harness(max_batch_size=4)
    a = h.submit("a")
    assert a.state == "running" and h.batcher.cancel(a) is False


def test_without_dynamic_batching_each_request_runs_alone():
    h = Harness(max_batch_size=8, unbatched=True)
    h.submit("a")
    h.submit("b", rows=3)
    h.submit("c")
    h.finish()
    h.finish()
    assert [h.tags(i) for i in range(3)] == [["a"], ["b"], ["c"]]


def test_two_instances_run_two_batches():
    h = Harness(max_batch_size=2, instances=2, max_queue_delay_ms=0)
    for t in "abcd":
        h.submit(t)
    # a and b each find a free instance; c and d queue behind them.
    assert [(h.tags(i), h.batches[i][1]) for i in range(2)] == [(["a"], 0), (["b"], 1)]
    h.finish()
    assert h.tags(2) == ["c", "d"] and h.batches[2][1] == 0


def test_timer_is_disarmed_once_nothing_waits():
    h = Harness(max_batch_size=2, max_queue_delay_ms=10, dispatch_when_idle=False)
    h.submit("a")
    assert h.clock.pending() == [pytest.approx(10 * MS)]
    h.submit("b")  # fills the batch
    assert h.clock.pending() == []
