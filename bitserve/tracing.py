"""OpenTelemetry traces: off unless `--otlp-traces-endpoint` (or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) names a collector, then exported over OTLP with the
SDK's batch processor (OTLP/gRPC by default; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL =
http/protobuf for OTLP/HTTP, whose endpoint is the full `.../v1/traces` URL). The SDK's
own variables apply too: OTEL_TRACES_SAMPLER (e.g. parentbased_traceidratio with
OTEL_TRACES_SAMPLER_ARG=0.01) keeps the cost of a busy server's spans down, and
OTEL_BSP_* tune the batch processor.

The span tree of one request:

    HTTP / gRPC handling       (SERVER; continues an incoming W3C `traceparent`)
      model {name}             (one model call: `ModelVersion.start`, whoever calls it:
        queue                   a protocol, an ensemble step, a BLS call)
        execute                (batch_size: the rows of the batch it ran in)
      llm {name}               (an LLM generation, with its token counts)
        queue, prefill, decode

Queue and execute are written when the call ends, from the times the batcher measured;
an LLM's three phases from its engine's RequestOutput metrics. With tracing off every
hook is one test of a module global, and nothing from the SDK is imported.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

_tracer: Any = None  # the SDK's tracer while tracing is on
_provider: Any = None


def configure(endpoint: str | None, service: str = "bitserve") -> bool:
    """Turn tracing on when a collector is named (False: it stays off)."""
    global _tracer, _provider
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise SystemExit(f"tracing needs bitserve's 'tracing' extra ({e})") from None

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    _provider, _tracer = provider, provider.get_tracer("bitserve")
    return True


def _exporter(endpoint: str) -> Any:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

    return Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://") or "://" not in endpoint)


def shutdown() -> None:
    """Export what is left and turn tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


# ------------------------------------------------------------ server spans


@contextlib.contextmanager
def server_span(name: str, carrier: Any, attributes: dict | None = None) -> Iterator[Any]:
    """A request's handling span (kind SERVER), the child of the caller's `traceparent`
    in `carrier` (HTTP headers or gRPC metadata, anything with `.get`)."""
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span(
        name, context=extract(carrier), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


# ------------------------------------------------------------ model calls


def model_call(model: str, version: int, ticket: Any) -> None:
    """A model call's span, from now until its ticket's result is in, with its queue
    wait and its batch's execution as children (times from the batcher's job)."""
    if _tracer is None:
        return
    from opentelemetry.trace import Status, StatusCode

    attributes = {"bitserve.model": model, "bitserve.model_version": version}
    span = _tracer.start_span(f"model {model}", attributes=attributes)
    if not span.is_recording():  # not sampled (OTEL_TRACES_SAMPLER)
        return
    started = time.time_ns()

    def done(result: Any) -> None:
        job = ticket.job
        if job is not None and job.batch_rows:
            _phases(span, started, time.time_ns(), job)
        if result.cancelled():
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
        elif (error := result.exception()) is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()

    ticket.result.add_done_callback(done)


def _phases(parent: Any, started: int, ended: int, job: Any) -> None:
    """The queue and execute children, laid from `started` by the job's own durations and
    kept within [started, ended]: the job's queue clock starts when it is submitted, which
    may be a little before the span (a gRPC call's ticket), and an execute end past the
    parent's would break the tree's nesting."""
    from opentelemetry.trace import set_span_in_context

    context = set_span_in_context(parent)
    queued = min(started + int(job.queue_seconds * 1e9), ended)
    _tracer.start_span("queue", context, start_time=started).end(end_time=queued)
    execute = _tracer.start_span(
        "execute",
        context,
        start_time=queued,
        attributes={"bitserve.batch_size": job.batch_rows, "bitserve.rows": job.rows},
    )
    execute.end(end_time=min(queued + int(job.compute_seconds * 1e9), ended))


def generation(model: str, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """An LLM engine's RequestOutputs as they come (tracing off: `outputs` itself);
    with tracing on, an `llm {model}` span over the generation whose queue, prefill and
    decode children and token counts come from the last output's metrics."""
    if _tracer is None:
        return outputs
    return _traced_generation(model, outputs)


async def _traced_generation(model: str, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    from opentelemetry.trace import Status, StatusCode

    # a span never made current: an async generator may resume in another context
    span = _tracer.start_span(f"llm {model}", attributes={"bitserve.model": model})
    if not span.is_recording():
        async with contextlib.aclosing(outputs) as outs:
            async for out in outs:
                yield out
        return
    last = None
    try:
        async with contextlib.aclosing(outputs) as outs:  # closing this closes the engine's
            async for out in outs:
                last = out
                yield out
    except BaseException as error:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        if last is not None:
            _llm_phases(span, last)
        span.end()


def _llm_phases(span: Any, out: Any) -> None:
    from opentelemetry.trace import set_span_in_context

    completion = out.outputs[0]
    span.set_attribute("gen_ai.usage.input_tokens", len(out.prompt_token_ids))
    span.set_attribute("gen_ai.usage.output_tokens", len(completion.token_ids))
    span.set_attribute("bitserve.cached_tokens", out.num_cached_tokens)
    if completion.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [completion.finish_reason])
    m = out.metrics
    wall = time.time_ns() - time.monotonic_ns()  # the engine's clock to the epoch
    marks = [m.get("arrival_time"), m.get("first_scheduled_time"), m.get("first_token_time")]
    if not all(marks):
        return
    arrival, scheduled, first = (wall + int(t * 1e9) for t in marks)
    now = time.time_ns()
    context = set_span_in_context(span)
    prompt = {"gen_ai.usage.input_tokens": len(out.prompt_token_ids)}
    prompt["bitserve.cached_tokens"] = out.num_cached_tokens
    for name, start, end, attributes in (
        ("queue", arrival, scheduled, None),
        ("prefill", scheduled, first, prompt),
        ("decode", first, now, {"gen_ai.usage.output_tokens": len(completion.token_ids)}),
    ):
        phase = _tracer.start_span(name, context, start_time=start, attributes=attributes)
        phase.end(end_time=end)
