"""Loading the repository at start: what the model-control mode asks for, the cold-start
report (logged "ready" only when ready answers 200, else what failed), a quiet garbage
collector once the models are in memory, and the repository poll."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from bitserve import coldstart
from bitserve.backends import preimport
from bitserve.repository.repository import Repository
from bitserve.server.state import ServerOptions

log = logging.getLogger("bitserve.server")


async def load(repository: Repository, options: ServerOptions) -> None:
    """Load what the model-control mode asks for, then (poll) keep the repository in sync."""
    started = time.perf_counter()
    if not repository.models:
        names = options.startup_models if options.model_control == "explicit" else None
        repository.scan(None if names is None or "*" in names else names)
    backends = {e.config.backend for e in repository.models.values() if e.config is not None}
    importing = time.perf_counter()
    await asyncio.to_thread(preimport, backends)
    import_seconds = time.perf_counter() - importing
    if options.lazy_load:
        repository.defer_all()
        log.info("lazy load: %s load on their first request", ", ".join(repository.lazy_models()))
        return
    await repository.load_all()
    log.info("repository loaded in %.2f s", time.perf_counter() - started)
    report(repository, options, import_seconds)
    quiet_gc()
    while options.model_control == "poll":
        await asyncio.sleep(options.poll_seconds)
        try:
            await repository.poll()
        except Exception:
            log.exception("repository poll failed")


def report(repository: Repository, options: ServerOptions, imports: float) -> None:
    versions = [v for e in repository.models.values() for v in e.versions.values() if v.ready]
    spans = [span for v in versions for span in v.spans]
    startup = coldstart.breakdown(
        options.process_started,
        options.imported,
        time.time(),
        loads=[load for load, _ in spans],
        warmups=[warmup for _, warmup in spans],
        preimport=imports,
    )
    for phase, seconds in startup.phases().items():
        repository.metrics.startup.labels(phase).set(seconds)
    reason = repository.not_ready_reason()
    if reason is None:  # "ready ..." only when /v2/health/ready answers 200
        log.info(startup.describe())
    else:
        log.error("loading ended, NOT ready: %s", reason)


def quiet_gc() -> None:
    """Keep the garbage collector from pausing the server under load.

    Loaded models leave millions of long-lived objects (torch modules, tokenizers); every
    full collection walks them all, and at thousands of requests per second those walks
    stalled whole batches for 70-190 ms (the p99 at concurrency 64 was 10x the p50).
    Freezing what exists after loading takes it out of every later collection, and a
    larger first-generation threshold makes collections rarer; request objects are
    freed by reference counting anyway. Not too large: a first-generation collection
    walks every young object alive, and at 50,000 one took 50-200 ms under an engine
    saturated by 96 streams (the p99 of a 429, issue 35); at 10,000, 33-51 ms, five
    times as often, about the same GC time in all (2 rounds, load 7-9 on 2 cores)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
