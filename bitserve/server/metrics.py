"""`/metrics`: Prometheus' text format of the server's registry, with the scrape-time
collectors (`collect`, registered by the app) that read the batchers' and LLM engines'
own state: nothing on the request path."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bitserve.repository import llmreplicas
from bitserve.server.state import ServerState


def routes(state: ServerState) -> list[Route]:
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", metrics)]


def collect(server: ServerState) -> Iterator[Metric]:
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
    yield from llmreplicas.collect(server.repository.models)
    for name, entry in server.repository.models.items():
        for number, version in entry.versions.items():
            report = version.report()
            if report.batch is None:
                continue  # llm versions export the engine's own metrics
            labels = [name, str(number)]
            depth.add_metric(labels, report.queued)
            healthy.add_metric(labels, report.healthy)
            rows.add_metric(labels, report.batch.inference_count)
            runs.add_metric(labels, report.batch.execution_count)
            for reason, count in report.restarts.items():
                restarts.add_metric([*labels, reason], count)
            retried.add_metric(labels, report.retried)
    yield from (depth, healthy, rows, runs, restarts, retried, draining)


def _engine_metrics(server: ServerState) -> Iterator[Metric]:
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
        "requests_failed_total": CounterMetricFamily(
            "bitserve_llm_requests_failed",
            "Requests that failed alone inside a step (the engine went on).",
            labels=labels,
        ),
    }
    experts = CounterMetricFamily(
        "bitserve_llm_expert_tokens",
        "Tokens routed to each MoE expert.",
        labels=[*labels, "expert"],
    )
    adapter_labels = [*labels, "adapter"]
    lora = {  # per LoRA adapter (llm/lora.py)
        "requests": CounterMetricFamily(
            "bitserve_llm_lora_requests", "Requests admitted per adapter.", labels=adapter_labels
        ),
        "tokens": CounterMetricFamily(
            "bitserve_llm_lora_tokens",
            "Tokens computed per adapter (prompt and generated).",
            labels=adapter_labels,
        ),
        "resident": GaugeMetricFamily(
            "bitserve_llm_lora_resident",
            "1 while the adapter holds a slot (max_loras), 0 when evicted.",
            labels=adapter_labels,
        ),
    }
    spec = {  # speculative decoding (llm/speculative.py), vLLM's spec_decode names
        "spec_proposed_tokens": CounterMetricFamily(
            "bitserve_llm_spec_decode_num_draft_tokens", "Tokens proposed.", labels=labels
        ),
        "spec_accepted_tokens": CounterMetricFamily(
            "bitserve_llm_spec_decode_num_accepted_tokens", "Proposals accepted.", labels=labels
        ),
        "spec_emitted_tokens": CounterMetricFamily(
            "bitserve_llm_spec_decode_num_emitted_tokens",
            "Tokens emitted by speculative steps (accepted and the target's own).",
            labels=labels,
        ),
    }
    by_position = {
        "spec_proposed_per_position": CounterMetricFamily(
            "bitserve_llm_spec_decode_num_draft_tokens_per_pos",
            "Proposals at each position after the last token (0 first).",
            labels=[*labels, "position"],
        ),
        "spec_accepted_per_position": CounterMetricFamily(
            "bitserve_llm_spec_decode_num_accepted_tokens_per_pos",
            "Proposals accepted at each position (their ratio to the proposed: the "
            "acceptance rate by position).",
            labels=[*labels, "position"],
        ),
    }
    restarts = CounterMetricFamily(
        "bitserve_llm_engine_restarts",
        "Times the engine's step loop died and was restarted by its supervisor.",
        labels=labels,
    )
    for name, entry in server.repository.models.items():
        for number, version in entry.versions.items():
            report = version.report()
            snapshot = report.engine
            if snapshot is None:
                continue
            restarts.add_metric([name, str(number)], float(report.engine_restarts))
            for key, family in families.items():
                family.add_metric([name, str(number)], float(snapshot[key]))
            for expert, count in enumerate(snapshot["tokens_per_expert"]):
                experts.add_metric([name, str(number), str(expert)], float(count))
            for adapter, stats in snapshot.get("lora", {}).items():
                for key, family in lora.items():
                    family.add_metric([name, str(number), adapter], float(stats[key]))
            if snapshot.get("spec_proposed_per_position"):  # speculating models only
                for key, family in spec.items():
                    family.add_metric([name, str(number)], float(snapshot[key]))
                for key, family in by_position.items():
                    for position, count in enumerate(snapshot[key]):
                        family.add_metric([name, str(number), str(position)], float(count))
    yield from (
        *families.values(),
        experts,
        *lora.values(),
        restarts,
        *spec.values(),
        *by_position.values(),
    )
