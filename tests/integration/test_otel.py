"""pgqueue.contrib.otel with the OpenTelemetry SDK's in-memory exporters, a real worker and
PostgreSQL: producer and consumer spans share a trace, failures are recorded, metrics count."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import pgqueue
from pgqueue.contrib import otel
from tests.helpers import running_worker

FAST = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 0.2, "reaper_interval": 1.0}


@dataclass
class Telemetry:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer_provider: TracerProvider

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """Each data point of metric ``name`` by its sorted attributes."""
        data = self.metrics.get_metrics_data()
        found: dict[tuple[tuple[str, Any], ...], Any] = {}
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        for point in metric.data.data_points:
                            found[tuple(sorted((point.attributes or {}).items()))] = point
        return found


@pytest.fixture
def telemetry(app: pgqueue.App) -> Iterator[Telemetry]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    otel.instrument(app, tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        yield Telemetry(exporter, reader, tracer_provider)
    finally:
        otel.uninstrument(app)
        tracer_provider.shutdown()
        meter_provider.shutdown()


def by_kind(spans: list[ReadableSpan], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind is kind]


async def test_a_job_runs_in_a_consumer_span_that_is_a_child_of_its_enqueue_span(
    app: pgqueue.App, telemetry: Telemetry
) -> None:
    seen: dict[str, Any] = {}

    @app.task(queue="mail")
    async def send(ctx: pgqueue.JobContext) -> None:
        seen["async"] = trace.get_current_span().get_span_context().span_id
        seen["meta"] = ctx.meta

    @app.task(queue="mail")
    def render() -> None:  # a thread: the span reaches it through the copied context
        seen["sync"] = trace.get_current_span().get_span_context().span_id

    first = send.configure(meta={"tenant": "acme"}).enqueue()
    second = render.enqueue()
    async with running_worker(app, **FAST):
        await app.wait_async(first, timeout=30)
        await app.wait_async(second, timeout=30)
    spans = telemetry.finished()
    producers = by_kind(spans, SpanKind.PRODUCER)
    consumers = {s.attributes["messaging.message.id"]: s for s in by_kind(spans, SpanKind.CONSUMER)}  # type: ignore[index]
    assert [p.name for p in producers] == ["publish mail", "publish mail"]
    for producer, job_id, key in ((producers[0], first, "async"), (producers[1], second, "sync")):
        attrs = dict(producer.attributes or {})
        assert attrs["messaging.system"] == "pgqueue"
        assert attrs["messaging.operation.type"] == "send"
        assert attrs["messaging.destination.name"] == "mail"
        assert attrs["messaging.message.id"] == str(job_id)
        consumer = consumers[str(job_id)]
        assert consumer.name == "process mail"
        assert consumer.parent is not None
        assert consumer.context.trace_id == producer.context.trace_id
        assert consumer.parent.span_id == producer.context.span_id
        assert consumer.status.status_code is StatusCode.UNSET
        assert seen[key] == consumer.context.span_id  # the handler runs inside it
        cattrs = dict(consumer.attributes or {})
        assert cattrs["pgqueue.job.attempt"] == 1 and cattrs["pgqueue.job.outcome"] == "succeeded"
    # The caller's own meta is kept; the carrier sits under the reserved key beside it.
    assert seen["meta"]["tenant"] == "acme"
    assert seen["meta"][otel.META_KEY]["traceparent"].startswith("00-")


async def test_failures_are_recorded_on_the_span_and_counted_by_outcome(
    app: pgqueue.App, telemetry: Telemetry
) -> None:
    @app.task(max_attempts=2, backoff=pgqueue.Backoff(base=0.01, cap=0.01))
    async def flaky(ctx: pgqueue.JobContext) -> None:
        raise RuntimeError(f"boom {ctx.attempt}")

    job = flaky.enqueue()
    async with running_worker(app, **FAST):
        with pytest.raises(pgqueue.JobFailedError):
            await app.wait_async(job, timeout=30)
    consumers = by_kind(telemetry.finished(), SpanKind.CONSUMER)
    producer = by_kind(telemetry.finished(), SpanKind.PRODUCER)[0]
    assert [dict(s.attributes or {})["pgqueue.job.outcome"] for s in consumers] == [
        "retrying", "dead",
    ]  # fmt: skip
    for attempt, span in enumerate(consumers, 1):
        assert span.parent is not None and span.parent.span_id == producer.context.span_id
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == f"RuntimeError: boom {attempt}"
        (event,) = span.events
        assert event.name == "exception"
        assert dict(event.attributes or {})["exception.message"] == f"boom {attempt}"
    completed = telemetry.points("pgqueue.jobs.completed")
    labels = (("messaging.destination.name", "default"), ("pgqueue.task.name", "flaky"))
    assert completed[(*labels[:1], ("pgqueue.job.outcome", "retrying"), *labels[1:])].value == 1
    assert completed[(*labels[:1], ("pgqueue.job.outcome", "dead"), *labels[1:])].value == 1


async def test_a_batch_is_one_producer_span_and_metrics_count_every_job(
    app: pgqueue.App, telemetry: Telemetry
) -> None:
    @app.task(queue="bulk")
    async def item(n: int) -> int:
        return n

    written = app.enqueue_many([("item", {"n": n}) for n in range(3)])
    assert written == 3
    ids = [j.id for j in app.find_jobs(task="item")]
    async with running_worker(app, **FAST):
        for job_id in ids:
            await app.wait_async(job_id, timeout=30)
    spans = telemetry.finished()
    (producer,) = by_kind(spans, SpanKind.PRODUCER)
    attrs = dict(producer.attributes or {})
    assert producer.name == "publish bulk"
    assert attrs["messaging.batch.message_count"] == 3
    assert attrs["pgqueue.enqueue.operation"] == "enqueue_many"
    assert "messaging.message.id" not in attrs  # COPY returns no ids
    consumers = by_kind(spans, SpanKind.CONSUMER)
    assert len(consumers) == 3
    assert all(c.parent is not None and c.parent.span_id == producer.context.span_id
               for c in consumers)  # fmt: skip

    labels = (("messaging.destination.name", "bulk"), ("pgqueue.task.name", "item"))
    assert telemetry.points("pgqueue.jobs.enqueued")[labels].value == 3
    done = (labels[0], ("pgqueue.job.outcome", "succeeded"), labels[1])
    assert telemetry.points("pgqueue.jobs.completed")[done].value == 3
    duration = telemetry.points("pgqueue.jobs.duration")[done]
    assert duration.count == 3 and duration.sum >= 0
    pickup = telemetry.points("pgqueue.jobs.pickup_latency")[labels]
    assert pickup.count == 3 and 0 <= pickup.sum < 60


def test_instrument_is_idempotent_and_uninstrument_removes_every_hook(app: pgqueue.App) -> None:
    before = (len(app.around_enqueue_hooks), len(app.enqueue_hooks), len(app.middleware_stack))
    otel.instrument(app)
    otel.instrument(app)
    assert (len(app.around_enqueue_hooks), len(app.enqueue_hooks), len(app.middleware_stack)) == (
        before[0] + 1, before[1] + 1, before[2] + 1,
    )  # fmt: skip
    otel.uninstrument(app)
    assert (len(app.around_enqueue_hooks), len(app.enqueue_hooks), len(app.middleware_stack)) == (
        before
    )
