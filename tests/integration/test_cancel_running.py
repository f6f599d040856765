"""Cancelling a running job: its worker stops the attempt and the job ends cancelled, never
retried, with every write still fenced. Real workers on a real database; workers poll once a
minute and beat every few seconds, so a stop within a second came by NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
SLOW_BEAT = {"lease": 30.0, "heartbeat_interval": 10.0, "poll_interval": 60.0,
             "reaper_interval": 1.0}  # fmt: skip
FAST_BEAT = {**SLOW_BEAT, "lease": 3.0, "heartbeat_interval": 0.3}


def status(conn: Conn, job_id: int) -> tuple[str, int, str | None]:
    row = conn.execute(
        "SELECT status::text, attempts, last_error FROM pgqueue_jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), row[2]


async def test_a_running_async_handler_is_cancelled_at_once_and_never_retried(
    app: pgqueue.App, conn: Conn
) -> None:
    started = asyncio.Event()
    stopped: list[str] = []

    @app.task(max_attempts=5)
    async def long_job() -> None:
        started.set()
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            stopped.append("cancelled")
            raise

    job = long_job.enqueue()
    async with running_worker(app, **SLOW_BEAT):
        await asyncio.wait_for(started.wait(), 30)
        asked = time.monotonic()
        assert await app.cancel_async(job) == pgqueue.CancelResult.REQUESTED
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)
        assert time.monotonic() - asked < 5  # NOTIFY, not the heartbeat 10 s away
        await asyncio.sleep(1.5)  # a retry would have been claimed by now
    assert stopped == ["cancelled"]
    state, attempts, error = status(conn, job)
    assert (state, attempts) == ("cancelled", 1) and error is not None and "Cancelled" in error
    with pytest.raises(pgqueue.JobCancelledError):
        app.wait(job, timeout=1)


async def test_the_heartbeat_delivers_a_cancel_whose_notification_was_missed(
    app: pgqueue.App, conn: Conn
) -> None:
    started = asyncio.Event()

    @app.task
    async def long_job() -> None:
        started.set()
        await asyncio.sleep(120)

    job = long_job.enqueue()
    async with running_worker(app, listen=False, **FAST_BEAT):
        await asyncio.wait_for(started.wait(), 30)
        assert app.cancel(job) == "cancel requested"
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)


async def test_a_sync_handler_is_abandoned_its_late_result_refused_and_it_can_look(
    app: pgqueue.App, conn: Conn
) -> None:
    started = threading.Event()
    saw: list[bool] = []
    finish = threading.Event()

    @app.task
    def crunch(ctx: pgqueue.JobContext) -> str:
        started.set()
        finish.wait(30)
        saw.append(ctx.cancelled)
        return "late result"

    job = crunch.enqueue()
    async with running_worker(app, **SLOW_BEAT):
        await asyncio.to_thread(started.wait, 30)
        assert app.cancel(job) == "cancel requested"
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)
        finish.set()
        await wait_until_async(lambda: saw == [True], timeout=30)
        await asyncio.sleep(0.5)
    row = conn.execute("SELECT status::text, result FROM pgqueue_jobs WHERE id = %s", (job,))
    assert row.fetchone() == ("cancelled", None)  # the thread's success was fenced out


async def test_check_cancelled_stops_a_cooperative_sync_handler(
    app: pgqueue.App, conn: Conn
) -> None:
    steps: list[int] = []
    started = threading.Event()

    @app.task
    def steps_job(ctx: pgqueue.JobContext) -> None:
        for step in range(600):
            started.set()
            ctx.check_cancelled()
            steps.append(step)
            time.sleep(0.05)

    job = steps_job.enqueue()
    async with running_worker(app, **SLOW_BEAT):
        await asyncio.to_thread(started.wait, 30)
        app.cancel(job)
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)
        count = len(steps)
        await asyncio.sleep(0.3)
        assert len(steps) <= count + 1  # it stopped at its next check
    assert len(steps) < 600


async def test_a_handler_that_fails_after_the_cancel_ends_cancelled_not_retrying(
    app: pgqueue.App, conn: Conn
) -> None:
    started = asyncio.Event()

    @app.task(max_attempts=5)
    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    job = stubborn.enqueue()
    async with running_worker(app, **SLOW_BEAT):
        await asyncio.wait_for(started.wait(), 30)
        app.cancel(job)
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)
    assert status(conn, job)[1] == 1


async def test_a_handler_that_finishes_before_the_cancel_lands_keeps_its_success(
    app: pgqueue.App, conn: Conn
) -> None:
    """Cancel against success: a handler that ignores the cancellation and returns wrote its
    success first; the job is succeeded, and the cancel did no harm."""
    started = asyncio.Event()

    @app.task
    async def shrug() -> str:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(120)
        return "done anyway"

    job = shrug.enqueue()
    async with running_worker(app, **SLOW_BEAT):
        await asyncio.wait_for(started.wait(), 30)
        app.cancel(job)
        await wait_until_async(lambda: status(conn, job)[0] != "running", timeout=30)
    assert status(conn, job)[0] == "succeeded"
    assert app.wait(job, timeout=1) == "done anyway"


async def test_a_crashed_workers_job_that_was_asked_to_cancel_is_cancelled_by_the_reaper(
    app: pgqueue.App, conn: Conn
) -> None:
    job = app.enqueue("orphan", {}, max_attempts=5, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', attempts = 1, claimed_at = now(),"
        " lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 second'"
        " WHERE id = %s",
        (job,),
    )
    assert app.cancel(job) == "cancel requested"
    async with running_worker(app, **SLOW_BEAT):
        await wait_until_async(lambda: status(conn, job)[0] == "cancelled", timeout=30)
        await asyncio.sleep(1.5)
    assert status(conn, job)[:2] == ("cancelled", 1)


async def test_a_prefetched_job_is_cancelled_before_it_starts(app: pgqueue.App, conn: Conn) -> None:
    ran: list[int] = []
    gate = asyncio.Event()

    @app.task
    async def one(n: int) -> None:
        ran.append(n)
        await gate.wait()

    first = one.enqueue(n=1)
    second = one.enqueue(n=2)
    async with running_worker(app, concurrency=1, **SLOW_BEAT) as worker:
        await wait_until_async(lambda: ran == [1], timeout=30)
        assert worker.state is not None
        held = {h.job.id: h.phase.value for h in worker.state.held.values()}
        app.cancel(second)
        await wait_until_async(lambda: status(conn, second)[0] == "cancelled", timeout=30)
        gate.set()
        await wait_until_async(lambda: status(conn, first)[0] == "succeeded", timeout=30)
    assert ran == [1], held
