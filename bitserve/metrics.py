"""Prometheus metrics: real histograms, labels bounded to model and version.

Triton's latency metrics are cumulative counters that cannot give a p99; here request,
queue and compute duration and the executed batch size are histograms. Counters and
gauges that the batcher already keeps (queue depth, rows inferred) are read at scrape
time by a collector, so the request path pays only for the histogram observations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip
FAILURE_REASONS = ("rejected", "timeout", "cancelled", "backend", "invalid", "unavailable", "other")


class Metrics:
    """Every metric of one server, on its own registry (so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, mv = self.registry, ("model", "version")
        self.request_duration = Histogram(
            "bitserve_request_duration_seconds",
            "Server-side time of an infer request, from body read to response built.",
            mv,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "bitserve_queue_duration_seconds",
            "Time a request waited in the batcher's queue before its batch started.",
            mv,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "bitserve_compute_duration_seconds",
            "Time one batch took on its instance: merge, predict and split.",
            mv,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "bitserve_batch_size",
            "Rows in each executed batch.",
            mv,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "bitserve_request_success", "Infer requests answered 200.", mv, registry=r
        )
        self.failure = Counter(
            "bitserve_request_failure",
            "Infer requests that failed, by reason.",
            (*mv, "reason"),
            registry=r,
        )
        self.inflight = Gauge(
            "bitserve_inflight_requests", "Infer requests being handled.", mv, registry=r
        )
        self.load_seconds = Gauge(
            "bitserve_model_load_seconds", "Time to load and warm a model version.", mv, registry=r
        )
        self.warmup_seconds = Gauge(
            "bitserve_model_warmup_seconds", "Time the warmup requests took.", mv, registry=r
        )
        self.startup = Gauge(
            "bitserve_startup_seconds",
            "Cold start: process start to ready, by phase (import, load, warmup, other, total).",
            ("phase",),
            registry=r,
        )
        self._llm_metrics(r, mv)
        self._rollout_metrics(r)
        self._cache_metrics(r, mv)

    def _llm_metrics(self, r: CollectorRegistry, mv: tuple[str, str]) -> None:
        """vLLM's definitions, so users can compare: TTFT from arrival, TPOT excludes
        the first token, ITL between consecutive token arrivals."""

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, mv, buckets=TOKEN_BUCKETS, registry=r)

        self.llm_ttft = histogram(
            "bitserve_llm_time_to_first_token_seconds", "Time to first token."
        )
        self.llm_tpot = histogram(
            "bitserve_llm_time_per_output_token_seconds",
            "Decode time per output token, the first token excluded.",
        )
        self.llm_itl = histogram("bitserve_llm_inter_token_latency_seconds", "Inter-token latency.")
        self.llm_e2e = histogram("bitserve_llm_e2e_request_latency_seconds", "End-to-end latency.")
        self.llm_queue = histogram(
            "bitserve_llm_request_queue_time_seconds", "Time waiting before first scheduled."
        )
        self.llm_prompt_tokens = Counter(
            "bitserve_llm_prompt_tokens", "Prompt tokens processed.", mv, registry=r
        )
        self.llm_generation_tokens = Counter(
            "bitserve_llm_generation_tokens", "Tokens generated.", mv, registry=r
        )
        self.llm_finished = Counter(
            "bitserve_llm_request_success",
            "Finished LLM requests by finish reason (stop, length, abort).",
            (*mv, "finished_reason"),
            registry=r,
        )

    def _rollout_metrics(self, r: CollectorRegistry) -> None:
        """Canary and shadow traffic (bitserve/rollout)."""
        self.canary_weight = Gauge(
            "bitserve_rollout_canary_weight_percent",
            "Percent of a model's unpinned requests routed to its canary version.",
            ("model", "version"),
            registry=r,
        )
        self.rollbacks = Counter(
            "bitserve_rollout_rollbacks",
            "Canaries rolled back automatically (error rate or p99 significantly worse).",
            ("model", "version"),
            registry=r,
        )
        self.shadow_sent = Counter(
            "bitserve_shadow_mirrors_sent",
            "Request copies queued for the shadow.",
            ("model",),
            registry=r,
        )
        self.shadow_dropped = Counter(
            "bitserve_shadow_mirrors_dropped",
            "Request copies dropped: the shadow's queue was full or it was not ready.",
            ("model",),
            registry=r,
        )

    def _cache_metrics(self, r: CollectorRegistry, mv: tuple[str, str]) -> None:
        """The response cache of models that enable it (repository/cache.py)."""
        self.cache_hits = Counter(
            "bitserve_cache_hits", "Requests answered from the response cache.", mv, registry=r
        )
        self.cache_misses = Counter(
            "bitserve_cache_misses",
            "Cacheable requests not found in the response cache (then run and kept).",
            mv,
            registry=r,
        )
        self.cache_evictions = Counter(
            "bitserve_cache_evictions",
            "Answers dropped from the response cache to stay within its bound (LRU).",
            mv,
            registry=r,
        )
        self.cache_bytes = Gauge(
            "bitserve_cache_bytes", "Bytes held by the response cache.", mv, registry=r
        )

    def add_collector(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """Register a scrape-time collector (a function yielding metric families)."""

        class _Collector:
            def collect(self) -> Iterator[Metric]:
                return collect()

        self.registry.register(_Collector())


def gauge(name: str, doc: str, samples: list[tuple[tuple[str, str], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["model", "version"])
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family
