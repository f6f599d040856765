"""Log records written while a job runs name it (pgqueue.JobLogFilter), with a real worker."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import pytest

import pgqueue
from examples.json_logging import JsonFormatter
from tests.helpers import running_worker, wait_until_async

FAST = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 0.2, "reaper_interval": 1.0}
mine = logging.getLogger("myapp.jobs")


def capture(caplog: pytest.LogCaptureFixture) -> None:
    """caplog's handler with the filter (it is a new handler in each test phase)."""
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(pgqueue.JobLogFilter())


def job_fields(record: logging.LogRecord) -> tuple[Any, ...] | None:
    if not hasattr(record, "job_id"):
        return None
    return (record.job_id, record.task, record.queue, record.attempt)  # type: ignore[attr-defined]


def test_pgqueue_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("pgqueue").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


async def test_records_written_during_a_job_carry_its_id_task_queue_and_attempt(
    app: pgqueue.App, caplog: pytest.LogCaptureFixture
) -> None:
    """Async handlers on the loop, sync ones in a thread, pgqueue's own records about the job
    (a sync handler abandoned at its timeout): all name the attempt; records outside a job and
    a caller's own extra= are left alone."""

    @app.task(queue="mail", backoff=pgqueue.Backoff(base=0.01, cap=0.01))
    async def send(ctx: pgqueue.JobContext) -> None:
        mine.info("sending")
        if ctx.attempt == 1:
            raise RuntimeError("smtp down")

    @app.task(queue="reports")
    def render() -> None:
        mine.info("rendering", extra={"task": "my own"})

    @app.task(queue="reports", timeout=0.2, max_attempts=1)
    def slow() -> None:
        time.sleep(0.6)

    capture(caplog)
    first = send.enqueue()
    second = render.enqueue()
    third = slow.enqueue()
    async with running_worker(app, concurrency=2, **FAST):
        await app.wait_async(first, timeout=30)
        await app.wait_async(second, timeout=30)
        with pytest.raises(pgqueue.JobFailedError):
            await app.wait_async(third, timeout=30)
    records = caplog.records
    ours = [(r.getMessage(), job_fields(r)) for r in records if r.name == "myapp.jobs"]
    assert sorted(ours, key=str) == sorted([
        ("sending", (first, "send", "mail", 1)),
        ("sending", (first, "send", "mail", 2)),
        ("rendering", (second, "my own", "reports", 1)),  # the caller's extra wins
    ], key=str)  # fmt: skip
    abandoned = [r for r in records if "abandoned at its" in r.getMessage()]
    assert [job_fields(r) for r in abandoned] == [(third, "slow", "reports", 1)]
    started = [r for r in records if r.name == "pgqueue.worker" and "started" in r.getMessage()]
    assert started and job_fields(started[0]) is None


def test_the_json_recipe_writes_the_job_fields() -> None:
    from pgqueue.logcontext import current_job
    from pgqueue.worker.state import ClaimedJob

    job = ClaimedJob(7, "mail", "send", {}, 2, 5, uuid.uuid4(), 0.0)
    token = current_job.set(job)
    try:
        record = mine.makeRecord(mine.name, logging.INFO, __file__, 1, "hi %s", ("there",), None)
        pgqueue.JobLogFilter().filter(record)
    finally:
        current_job.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hi there" and line["level"] == "INFO"
    assert (line["job_id"], line["task"], line["queue"], line["attempt"]) == (7, "send", "mail", 2)


async def test_pgqueue_records_about_a_job_outside_its_attempt_name_it_too(
    app: pgqueue.App, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancel request is seen by the worker's notifier, not in the attempt: its record names
    the job through extra=, filter or no filter."""
    started: list[int] = []

    @app.task(queue="long")
    async def wait_forever(ctx: pgqueue.JobContext) -> None:
        started.append(ctx.job_id)
        await asyncio.sleep(3600)

    caplog.set_level(logging.INFO, logger="pgqueue")
    job = wait_forever.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: started == [job], timeout=30)
        await app.cancel_async(job)
        with pytest.raises(pgqueue.JobCancelledError):
            await app.wait_async(job, timeout=30)
    (record,) = [r for r in caplog.records if "cancel requested" in r.getMessage()]
    assert job_fields(record) == (job, "wait_forever", "long", 1)
