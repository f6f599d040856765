"""OpenTelemetry traces and metrics for an app, through the OpenTelemetry API only.

``pip install 'pgqueue-jobs[otel]'``, then once, where the app is set up::

    from pgqueue.contrib import otel
    otel.instrument(app)

An explicit call, as OpenTelemetry's own instrumentations do, rather than whenever the API
happens to be importable: nothing is traced that the application did not ask for, and an app
that is not instrumented pays nothing on any path. Spans and metrics go to the global tracer
and meter providers (or those given): without an SDK configured, every call is a no-op.

What it records (messaging semantic conventions, ``messaging.system = "pgqueue"``):

- a PRODUCER span per call that writes jobs (``publish {queue}``, ``messaging.operation.type =
  "send"``): one per ``enqueue``, one per ``enqueue_many``/``chain``/``group`` batch (with
  ``messaging.batch.message_count``); its context travels in each job's ``meta`` under the
  reserved key ``"otel"`` (a W3C ``traceparent``/``tracestate`` carrier, or whatever the
  configured propagator writes), so no column is added;
- a CONSUMER span per attempt (``process {queue}``), a child of that context: every attempt of a
  job, and every job of a batch, joins the producer's trace. The handler's own spans (sync
  handlers' too: they run in a copy of the context) are its children. A failure records the
  exception and sets the span's status to ERROR;
- metrics: ``pgqueue.jobs.enqueued`` and ``pgqueue.jobs.completed`` (counters; the latter with
  ``pgqueue.job.outcome``), ``pgqueue.jobs.duration`` (the handler's run time) and
  ``pgqueue.jobs.pickup_latency`` (due to claimed, on the database's clock), in seconds.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pgqueue import App, Fail, JobContext, __version__
from pgqueue.hooks import Publish, check_middleware

__all__ = ["META_KEY", "SYSTEM", "instrument", "uninstrument"]

#: ``messaging.system`` of every span: the queue is pgqueue's (PostgreSQL is its store).
SYSTEM = "pgqueue"
#: The key of a job's ``meta`` that carries the producer's trace context: reserved.
META_KEY = "otel"
#: Seconds; OpenTelemetry's default boundaries are for milliseconds.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

_instrumented: weakref.WeakKeyDictionary[App, _Instrumentation] = weakref.WeakKeyDictionary()


def instrument(
    app: App,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> None:
    """Trace and measure ``app``'s enqueues and jobs (both sides: call it in producers and
    workers alike). Calling it again for the same app does nothing."""
    if app in _instrumented:
        return
    inst = _Instrumentation(
        trace.get_tracer(__name__, __version__, tracer_provider),
        metrics.get_meter(__name__, __version__, meter_provider),
    )
    _instrumented[app] = inst
    app.around_enqueue(inst.publish)
    app.on_enqueue(inst.inject)
    # Outermost: the other middleware's spans and logs are inside the job's span.
    app.middleware_stack.insert(0, check_middleware(inst.process))


def uninstrument(app: App) -> None:
    """Undo ``instrument`` (the jobs written meanwhile keep their trace context)."""
    inst = _instrumented.pop(app, None)
    if inst is None:
        return
    app.around_enqueue_hooks[:] = [h for h in app.around_enqueue_hooks if h != inst.publish]
    app.enqueue_hooks[:] = [h for h in app.enqueue_hooks if h != inst.inject]
    app.middleware_stack[:] = [h for h in app.middleware_stack if h != inst.process]


class _Instrumentation:
    def __init__(self, tracer: trace.Tracer, meter: metrics.Meter) -> None:
        self.tracer = tracer
        self.enqueued = meter.create_counter(
            "pgqueue.jobs.enqueued", "{job}", "Jobs handed to PostgreSQL by enqueue calls that "
            "succeeded (a duplicate of a unique job included)",
        )  # fmt: skip
        self.completed = meter.create_counter(
            "pgqueue.jobs.completed", "{job}", "Attempts ended, by outcome"
        )
        self.duration = meter.create_histogram(
            "pgqueue.jobs.duration", "s", "Handler run time of an attempt",
            explicit_bucket_boundaries_advisory=BUCKETS,
        )  # fmt: skip
        self.pickup = meter.create_histogram(
            "pgqueue.jobs.pickup_latency", "s",
            "From when a job was due to when an attempt was claimed (the database's clock)",
            explicit_bucket_boundaries_advisory=BUCKETS,
        )  # fmt: skip

    @contextlib.contextmanager
    def publish(self, publish: Publish) -> Iterator[None]:
        """The producer span around one call: current while its jobs are built, so that
        ``inject`` writes its context into each."""
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "pgqueue.enqueue.operation": publish.operation,
        }
        with self.tracer.start_as_current_span(
            "publish", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            try:
                yield
            finally:  # known once the jobs are built (failed or not)
                queues = {queue for _, queue in publish.counts}
                tasks = {task for task, _ in publish.counts}
                if len(queues) == 1:
                    (queue,) = queues
                    span.update_name(f"publish {queue}")
                    span.set_attribute("messaging.destination.name", queue)
                if len(tasks) == 1:
                    span.set_attribute("pgqueue.task.name", next(iter(tasks)))
                if publish.operation != "enqueue":
                    span.set_attribute("messaging.batch.message_count", publish.jobs)
            if publish.ids is not None and len(publish.ids) == 1:
                span.set_attribute("messaging.message.id", str(publish.ids[0]))
            for (task, queue), count in publish.counts.items():
                self.enqueued.add(
                    count, {"messaging.destination.name": queue, "pgqueue.task.name": task}
                )

    def inject(self, task: str, args: Mapping[str, Any], meta: dict[str, Any]) -> None:
        """The current (producer) span's context into the job's meta, unless the caller put a
        carrier there already (a job re-enqueued with its original trace)."""
        if META_KEY in meta:
            return
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if carrier:
            meta[META_KEY] = carrier

    async def process(self, ctx: JobContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        """The consumer span around one attempt, and its metrics."""
        carrier = (ctx.meta or {}).get(META_KEY)
        parent = propagate.extract(carrier) if isinstance(carrier, dict) else None
        labels = {"messaging.destination.name": ctx.queue, "pgqueue.task.name": ctx.task}
        self.pickup.record(max(ctx.pickup_seconds, 0.0), labels)
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": ctx.queue,
            "messaging.message.id": str(ctx.job_id),
            "pgqueue.task.name": ctx.task,
            "pgqueue.job.attempt": ctx.attempt,
            "pgqueue.job.max_attempts": ctx.max_attempts,
        }
        outcome = "succeeded"
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"process {ctx.queue}", context=parent, kind=SpanKind.CONSUMER,
            attributes=attributes, record_exception=False, set_status_on_exception=False,
        ) as span:  # fmt: skip
            try:
                return await call_next()
            except BaseException as exc:
                outcome = _outcome(ctx, exc)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise
            finally:
                span.set_attribute("pgqueue.job.outcome", outcome)
                measured = {**labels, "pgqueue.job.outcome": outcome}
                self.completed.add(1, measured)
                self.duration.record(time.perf_counter() - started, measured)


def _outcome(ctx: JobContext, exc: BaseException) -> str:
    """What the worker makes of an attempt that raised ``exc`` (see pgqueue.worker.executor):
    ``retrying``, ``dead``, ``cancelled`` (someone asked), or ``interrupted`` (the worker's own
    cancellation: shutdown or a lost lease; the job runs again)."""
    if ctx.cancelled:
        return "cancelled"
    if isinstance(exc, Fail):
        return "dead"
    if isinstance(exc, Exception):
        return "dead" if ctx.attempt >= ctx.max_attempts else "retrying"
    return "interrupted"  # CancelledError (or KeyboardInterrupt and the like)
