"""Health as a traffic gate, not a heartbeat.

- live (`/v2/health/live`, `/livez`): 503 while any instance is dead or wedged (a batch
  past its execution timeout). A watchdog notices within a quarter second, fails the
  batch the instance held, and restarts it; live turns 200 again once it is back.
- ready (`/v2/health/ready`, `/readyz`): 200 only when every model the repository asks
  for is loaded and warmed, no instance is restarting, and the server is not draining.
  Ray replicas are the exception: a model stays ready while one replica is healthy, and
  the body lists the others being replaced (`"degraded"`); it is not ready with none.
- startup (`/startupz`): 503 "loading" while models load, 500 naming the model when one
  is broken, 200 once everything loaded. Kubernetes can tell slow from broken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.server.http import error, json_response

if TYPE_CHECKING:
    from bitserve.server.app import Server

log = logging.getLogger("bitserve.server")

WATCHDOG_PERIOD_S = 0.25


class Health:
    def __init__(self, server: Server):
        self.server = server

    def routes(self) -> list[Route]:
        return [
            Route("/v2/health/live", self.live),
            Route("/livez", self.live),
            Route("/v2/health/ready", self.ready),
            Route("/readyz", self.ready),
            Route("/startupz", self.startup),
            Route("/metrics", self.metrics),
        ]

    async def live(self, request: Request) -> Response:
        sick = [
            f"model '{name}' version {v.version}: {problem}"
            for name, entry in self.server.repository.models.items()
            for v in entry.versions.values()
            if (problem := v.problem())
        ]
        return _answer(200 if not sick else 503, "; ".join(sick))

    async def ready(self, request: Request) -> Response:
        if self.server.draining:
            return _answer(503, "draining")
        reason = self.server.repository.not_ready_reason()
        lazy = self.server.repository.lazy_models()
        degraded = [
            f"model '{name}' version {v.version}: {why}"
            for name, entry in self.server.repository.models.items()
            for v in entry.versions.values()
            if (why := v.degraded())
        ]
        if reason is None and (lazy or degraded):  # ready, and it says what is missing
            body: dict = {"ready": True}
            if lazy:
                body["lazy_models"] = lazy
            if degraded:  # Ray replicas being replaced while the others serve
                body["degraded"] = degraded
            return json_response(body)
        return _answer(200 if reason is None else 503, reason or "")

    async def startup(self, request: Request) -> Response:
        repository = self.server.repository
        broken = [f"model '{e.name}': {e.error}" for e in repository.models.values() if e.error]
        if broken:
            return _answer(500, "; ".join(broken))
        return _answer(200 if repository.loaded else 503, "" if repository.loaded else "loading")

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(
            generate_latest(self.server.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def watchdog(self) -> None:
        """Restart dead or wedged instances; one restart per slot at a time."""
        restarting: set[tuple[Any, int]] = set()
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            for entry in list(self.server.repository.models.values()):
                for version in list(entry.versions.values()):
                    if version.state not in ("ready", "draining"):
                        continue
                    for slot, why in version.check():
                        key = (version, slot)
                        if key not in restarting:
                            restarting.add(key)
                            task = asyncio.create_task(version.restart(slot, why))
                            task.add_done_callback(lambda _, key=key: restarting.discard(key))


def _answer(status: int, reason: str) -> Response:
    if status == 200:
        return Response(status_code=200)
    return error(status, reason)


def collect(server: Server) -> Iterator[Metric]:
    """Scrape-time metrics read from the batchers: nothing on the request path."""
    depth = GaugeMetricFamily(
        "bitserve_queue_depth", "Requests waiting in the batcher.", labels=["model", "version"]
    )
    healthy = GaugeMetricFamily(
        "bitserve_instances_healthy",
        "Instances alive and not wedged.",
        labels=["model", "version"],
    )
    rows = CounterMetricFamily(
        "bitserve_inference_count",
        "Rows inferred (a batch of n counts n).",
        labels=["model", "version"],
    )
    runs = CounterMetricFamily(
        "bitserve_execution_count", "Batches executed.", labels=["model", "version"]
    )
    restarts = CounterMetricFamily(
        "bitserve_instance_restarts",
        "Instances restarted by the watchdog, by reason (wedged, died).",
        labels=["model", "version", "reason"],
    )
    retried = CounterMetricFamily(
        "bitserve_requests_retried",
        "Requests put back in the queue because their Ray replica died before starting them.",
        labels=["model", "version"],
    )
    draining = GaugeMetricFamily("bitserve_draining", "1 while the server drains.")
    draining.add_metric([], 1.0 if server.draining else 0.0)
    yield from _engine_metrics(server)
    for name, entry in server.repository.models.items():
        for number, version in entry.versions.items():
            if version.batcher is None:
                continue  # llm versions export the engine's own metrics
            labels = [name, str(number)]
            depth.add_metric(labels, version.batcher.queued)
            healthy.add_metric(labels, len(version.instances) - len(version.unhealthy))
            rows.add_metric(labels, version.batcher.stats.inference_count)
            runs.add_metric(labels, version.batcher.stats.execution_count)
            for reason, count in version.restarts.items():
                restarts.add_metric([*labels, reason], count)
            retried.add_metric(labels, version.retried)
    yield from (depth, healthy, rows, runs, restarts, retried, draining)


def _engine_metrics(server: Server) -> Iterator[Metric]:
    """The LLM engines' own state (vLLM's gauges): read under the engine lock."""
    labels = ["model", "version"]
    families = {
        "num_requests_running": GaugeMetricFamily(
            "bitserve_llm_num_requests_running", "Requests in the running batch.", labels=labels
        ),
        "num_requests_waiting": GaugeMetricFamily(
            "bitserve_llm_num_requests_waiting", "Requests waiting for the engine.", labels=labels
        ),
        "kv_cache_usage": GaugeMetricFamily(
            "bitserve_llm_kv_cache_usage_perc", "Fraction of KV blocks in use.", labels=labels
        ),
        "kv_waste": GaugeMetricFamily(
            "bitserve_llm_kv_cache_waste_perc",
            "Allocated but unused KV slots of running requests, as a fraction.",
            labels=labels,
        ),
        "prefix_cache_queries": CounterMetricFamily(
            "bitserve_llm_prefix_cache_queries", "Prompt tokens looked up.", labels=labels
        ),
        "prefix_cache_hits": CounterMetricFamily(
            "bitserve_llm_prefix_cache_hits", "Prompt tokens found cached.", labels=labels
        ),
        "num_preemptions": CounterMetricFamily(
            "bitserve_llm_num_preemptions", "Requests preempted (recomputed).", labels=labels
        ),
    }
    experts = CounterMetricFamily(
        "bitserve_llm_expert_tokens",
        "Tokens routed to each MoE expert.",
        labels=[*labels, "expert"],
    )
    restarts = CounterMetricFamily(
        "bitserve_llm_engine_restarts",
        "Times the engine's step loop died and was restarted by its supervisor.",
        labels=labels,
    )
    failed = CounterMetricFamily(
        "bitserve_llm_requests_failed",
        "Requests that failed alone inside a step (the engine went on).",
        labels=labels,
    )
    for name, entry in server.repository.models.items():
        for number, version in entry.versions.items():
            if version.llm is None or version.llm.engine is None or version.state != "ready":
                continue
            restarts.add_metric([name, str(number)], float(version.llm.restarts))
            failed.add_metric(
                [name, str(number)], float(version.llm.engine.engine.requests_failed_total)
            )
            snapshot = version.llm.engine.metrics().as_dict()
            for key, family in families.items():
                family.add_metric([name, str(number)], float(snapshot[key]))
            for expert, count in enumerate(snapshot["tokens_per_expert"]):
                experts.add_metric([name, str(number), str(expert)], float(count))
    yield from (*families.values(), experts, restarts, failed)
