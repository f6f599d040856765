"""Waiting for a job's result (App.wait, App.wait_async), on a real database with real workers.

A waiter is woken by the worker's announcement of the job's end; with workers that poll once a
minute and a waiter that looks on its own every few seconds, an answer within a second or so
can only have come from the announcement.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import db, results
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
NO_POLL = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}


@pytest.fixture(autouse=True)
def slow_own_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters look on their own once a minute here: an answer in seconds was announced."""
    monkeypatch.setattr(results, "LOOK_EVERY", 60.0)


async def test_wait_returns_the_result_as_soon_as_the_job_succeeds(app: pgqueue.App) -> None:
    gate = asyncio.Event()

    @app.task
    async def add(a: int, b: int) -> dict[str, int]:
        await gate.wait()
        return {"sum": a + b}

    job = add.enqueue(a=2, b=3)
    async with running_worker(app, **NO_POLL):
        waiter = asyncio.create_task(app.wait_async(job, timeout=30))
        await asyncio.sleep(0.5)
        assert not waiter.done()
        gate.set()
        started = time.monotonic()
        assert await waiter == {"sum": 5}
        assert time.monotonic() - started < 5
    assert app.wait(job, timeout=0) == {"sum": 5}  # finished already: answered at once
    got = app.get_job(job)
    assert got is not None and got.result == {"sum": 5}


async def test_a_sync_waiter_in_a_thread_is_woken_too(app: pgqueue.App) -> None:
    @app.task
    def slow() -> str:
        time.sleep(0.3)
        return "done"

    job = slow.enqueue()
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(app.wait(job, timeout=30)))
    thread.start()
    async with running_worker(app, **NO_POLL):
        await wait_until_async(lambda: not thread.is_alive(), timeout=30)
    assert answer == ["done"]


async def test_a_dead_job_raises_its_last_error_and_a_cancelled_one_says_so(
    app: pgqueue.App,
) -> None:
    @app.task(max_attempts=1)
    async def broken() -> None:
        raise ValueError("the input was bad")

    @app.task
    async def never() -> None: ...

    dead = broken.enqueue()
    cancelled = never.configure(delay=3600).enqueue()
    async with running_worker(app, **NO_POLL):
        with pytest.raises(pgqueue.JobFailedError, match="ValueError: the input was bad") as info:
            await app.wait_async(dead, timeout=30)
        assert info.value.job.status is pgqueue.Status.DEAD
        waiter = asyncio.create_task(app.wait_async(cancelled, timeout=30))
        await asyncio.sleep(0.3)
        assert app.cancel(cancelled)
        with pytest.raises(pgqueue.JobCancelledError, match="was cancelled"):
            await waiter


async def test_a_timeout_and_an_unknown_job_are_clear_errors(app: pgqueue.App) -> None:
    job = app.enqueue("nobody_runs_this", {}, allow_unknown=True)
    started = time.monotonic()
    with pytest.raises(pgqueue.WaitTimeoutError, match=f"job {job} had not finished after 0.5 s"):
        app.wait(job, timeout=0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(TimeoutError):  # also a TimeoutError, for code that catches those
        await app.wait_async(job, timeout=0.2)
    with pytest.raises(pgqueue.JobNotFoundError, match="no job 999999"):
        app.wait(999999)
    with pytest.raises(pgqueue.InvalidJobError, match="positive integer"):
        app.wait("7")  # type: ignore[arg-type]
    with pytest.raises(pgqueue.ConfigurationError, match="timeout"):
        app.wait(job, timeout=-1)


async def test_a_job_that_dies_by_the_reaper_wakes_its_waiter(app: pgqueue.App, conn: Conn) -> None:
    """A job whose last attempt's lease expired ends dead in the reaper, which announces it."""
    job = app.enqueue("orphan", {}, max_attempts=1, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', attempts = 1, claimed_at = now(),"
        " lease_token = gen_random_uuid(), lease_expires_at = now() - interval '1 second'"
        " WHERE id = %s",
        (job,),
    )
    waiter = asyncio.create_task(app.wait_async(job, timeout=30))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    async with running_worker(app, **NO_POLL):
        with pytest.raises(pgqueue.JobFailedError, match="LeaseExpired"):
            await waiter
    assert time.monotonic() - started < 10


async def test_nobody_waiting_means_no_announcements(app: pgqueue.App, conn: Conn) -> None:
    """The ack batch says whether anyone waits: with nobody, a worker sends nothing."""

    @app.task
    async def quick(n: int) -> None: ...

    conn.execute(f"LISTEN {db.done_channel_for(app.schema)}")
    app.enqueue_many([("quick", {"n": n}) for n in range(20)])
    async with running_worker(app, **NO_POLL):
        await wait_until_async(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'"
                ).fetchone()
                == (20,)
            ),
            timeout=30,
        )
        await asyncio.sleep(0.3)
    assert list(conn.notifies(timeout=0.2)) == []


async def test_a_waiter_whose_connection_is_lost_connects_again_and_gets_the_answer(
    app: pgqueue.App, conn: Conn
) -> None:
    """Waiting only reads: a lost connection (here terminated, as in a failover) is not the
    caller's problem while ``reconnect_timeout`` lasts."""
    gate = asyncio.Event()

    @app.task
    async def slow() -> str:
        await gate.wait()
        return "done"

    job = slow.enqueue()
    # The waiter's session: the only one without an application name besides ``conn``.
    waiter_session = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = '' AND pid <> pg_backend_pid()"
    )
    async with running_worker(app, **NO_POLL):
        waiter = asyncio.create_task(app.wait_async(job, timeout=60))
        (pid,) = await wait_until_async(lambda: conn.execute(waiter_session).fetchone())
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await wait_until_async(
            lambda: (conn.execute(waiter_session).fetchone() or (pid,))[0] != pid
        )
        assert not waiter.done()
        gate.set()
        assert await asyncio.wait_for(waiter, 30) == "done"
