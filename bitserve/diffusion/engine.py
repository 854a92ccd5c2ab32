"""Step-level continuous batching of denoising steps.

The engine holds `waiting` rows (submitted, not yet stepped) and `running` rows. Each
`step` is one network forward over every running row, wherever each is in its own
timestep sequence (per-row t, per-row guidance scale), with the conditional and
unconditional halves of all rows in the same batch (sampler.denoise). Invariants:

* a row submitted while a step runs joins the next step (up to `max_rows` running);
* a row cancelled while a step runs leaves before the next one, and its future ends
  with `Cancelled`; its slot is free for a waiting row at that same next step;
* a row's result depends only on its own parameters and seed (sampler.py), so batching
  changes throughput, never images;
* a step that raises fails the rows in it, not the engine: the loop goes on.

One thread runs the loop (`start`); tests call `step` directly instead, which makes
joins and leaves exact. Results are `concurrent.futures.Future`s: a worker thread
blocks on one, the event loop awaits it with `asyncio.wrap_future`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from bitserve.diffusion.params import GenerationParams
from bitserve.diffusion.sampler import Row, advance, denoise, new_row
from bitserve.diffusion.schedule import Schedule
from bitserve.diffusion.unet import Denoiser
from bitserve.inference import ClientGone, Overloaded  # Overloaded: more rows than max_waiting

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Cancelled(ClientGone):
    """The request was cancelled (its client went away) before its image was done."""


class EngineStopped(RuntimeError):
    """The engine shut down with the request unfinished (HTTP 503)."""


@dataclass
class Histogram:
    """Cumulative bucket counts and a sum, read by the Prometheus collector."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    images: int = 0
    cancelled: int = 0
    failed: int = 0
    uncond_rows: int = 0  # unconditional passes run (guided rows' second half)
    rows: Histogram = field(default_factory=lambda: Histogram(ROW_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.step_seconds if self.step_seconds else 0.0


class DiffusionEngine:
    def __init__(
        self,
        model: Denoiser,
        schedule: Schedule,
        max_rows: int = 64,
        max_waiting: int = 1024,
    ):
        self.model = model.eval()
        self.schedule = schedule
        # abar_t for t = 0..T-1, then 1 (the clean image) for sampler.advance's t' = -1
        self.abar = torch.cat([schedule.alphas_cumprod(), torch.ones(1, dtype=torch.float64)])
        self.max_rows = max_rows
        self.max_waiting = max_waiting
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self.stats = EngineStats()
        self.error: BaseException | None = None  # the loop thread's death, if it died
        self.last_progress = time.monotonic()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def size(self) -> int:
        return self.model.config.size

    # ------------------------------------------------------------ requests

    def submit(self, params: GenerationParams) -> Row:
        """Queue one image; its `future` gets a [H, W] float image in [0, 1]."""
        params.check(self.model.config.classes, self.schedule.steps)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        row = new_row(params, self.schedule, self.size, seed)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the diffusion engine is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise Overloaded(f"{len(self.waiting)} images already waiting (max_waiting)")
            self.waiting.append(row)
            self._cv.notify()
        return row

    def cancel(self, row: Row) -> None:
        """The row leaves at the next step (at once if it has not started)."""
        with self._cv:
            if row.state in ("waiting", "running"):
                row.state = "cancelled"

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- steps

    def step(self) -> int:
        """Admit waiting rows, drop cancelled ones, run one step over the rest; the
        number of rows stepped (0: nothing to do)."""
        rows = self._schedule()
        if not rows:
            return 0
        started = time.perf_counter()
        try:
            eps, uncond = denoise(self.model, rows)
            advance(rows, eps, self.abar)
        except Exception as e:  # the rows in this step fail; the engine goes on
            self._fail(rows, e)
            return len(rows)
        seconds = time.perf_counter() - started
        self._update(rows, seconds, uncond)
        return len(rows)

    def _schedule(self) -> list[Row]:
        now = time.perf_counter()
        with self._cv:
            for row in self.running:
                if row.state == "cancelled":
                    self._end(row, Cancelled("request cancelled"))
            self.running = [r for r in self.running if r.state == "running"]
            while self.waiting and len(self.running) < self.max_rows:
                row = self.waiting.popleft()
                if row.state == "cancelled":
                    self._end(row, Cancelled("request cancelled"))
                    continue
                row.state = "running"
                self.stats.queue.observe(now - row.arrival)
                self.running.append(row)
            return list(self.running)

    def _update(self, rows: list[Row], seconds: float, uncond: int) -> None:
        """The one place a step's outcome lands: stats, then finished rows leave."""
        with self._cv:
            self.stats.steps += 1
            self.stats.step_seconds += seconds
            self.stats.rows.observe(len(rows))
            self.stats.uncond_rows += uncond
            self.last_progress = time.monotonic()
            for row in rows:
                if row.done and row.state == "running":
                    row.state = "done"
                    self.stats.images += 1
                    row.future.set_result(row.image())
            # rows cancelled during this step stay until _schedule ends them
            self.running = [r for r in self.running if r.state != "done"]

    def _fail(self, rows: list[Row], error: Exception) -> None:
        with self._cv:
            for row in rows:
                if row.state == "running":
                    self.stats.failed += 1
                    row.state = "done"
                    row.future.set_exception(RuntimeError(f"denoising step failed: {error!r}"))
            self.running = [r for r in self.running if r.state != "done"]

    def _end(self, row: Row, error: BaseException) -> None:
        if isinstance(error, Cancelled):
            self.stats.cancelled += 1
        row.state = "cancelled"
        if not row.future.done():
            row.future.set_exception(error)

    # ----------------------------------------------------------------- loop

    def start(self) -> DiffusionEngine:
        self._thread = threading.Thread(target=self._loop, name="diffusion-engine", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self.pending:
                        self._cv.wait()
                        self.last_progress = time.monotonic()
                    if self._stopping:
                        return
                self.step()
        except BaseException as e:  # recorded (health reports it); no row is left hanging
            self.error = e
            with self._cv:
                for row in [*self.waiting, *self.running]:
                    self._end(row, EngineStopped(f"the diffusion engine died: {e!r}"))
            raise

    def stop(self) -> None:
        """End the loop; rows not finished fail with EngineStopped."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cv:
            for row in [*self.waiting, *self.running]:
                self._end(row, EngineStopped("the diffusion engine stopped"))
            self.waiting.clear()
            self.running = []
