"""Transactional completion: a handler that takes a psycopg connection has its writes committed
in the same transaction as its success ack, fenced by the lease token."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest

import pgqueue
from tests.helpers import give_lease_away, running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}


@pytest.fixture
def effects(conn: Conn) -> Conn:
    conn.execute("CREATE TABLE effects (job_id bigint, note text)")
    return conn


def effect_rows(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT job_id, note FROM effects ORDER BY job_id").fetchall()


def job(conn: Conn, job_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT status::text, attempts, result, last_error FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    return row


async def test_async_handler_writes_commit_with_the_ack(app: pgqueue.App, effects: Conn) -> None:
    @app.task
    async def charge(
        ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any], amount: int
    ) -> dict[str, int]:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.job_id, f"charged {amount}"))
        return {"amount": amount}

    job_id = charge.enqueue(amount=7)  # the connection is filled by the worker, not enqueued
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(lambda: job(effects, job_id)[0] == "succeeded")
        state = worker.state
        assert state is not None
        # Counted once the COMMIT's reply is in, which can come after the row shows succeeded.
        await wait_until_async(lambda: state.counters.succeeded == 1)
        assert worker.completer.writes == 0  # the ack went out in the handler's transaction
    assert job(effects, job_id)[:3] == ("succeeded", 1, {"amount": 7})
    assert effect_rows(effects) == [(job_id, "charged 7")]


async def test_sync_handler_writes_commit_with_the_ack(app: pgqueue.App, effects: Conn) -> None:
    @app.task
    def charge(ctx: pgqueue.JobContext, conn: psycopg.Connection[Any]) -> None:
        conn.execute("INSERT INTO effects VALUES (%s, 'sync')", (ctx.job_id,))

    job_id = charge.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: job(effects, job_id)[0] == "succeeded")
    assert effect_rows(effects) == [(job_id, "sync")]


async def test_a_failing_handler_leaves_no_effect_and_retries(
    app: pgqueue.App, effects: Conn
) -> None:
    app.backoff = pgqueue.Backoff(base=0.05, cap=0.1)

    @app.task(max_attempts=3)
    async def flaky(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.job_id, ctx.attempt))
        if ctx.attempt < 3:
            raise RuntimeError("after the write")

    job_id = flaky.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: job(effects, job_id)[0] == "succeeded")
    assert job(effects, job_id)[1] == 3
    assert effect_rows(effects) == [(job_id, "3")]  # only the attempt that succeeded


async def test_lost_lease_rolls_back_the_handlers_writes(app: pgqueue.App, effects: Conn) -> None:
    wrote, finish = asyncio.Event(), threading.Event()

    @app.task
    async def slow(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any]) -> str:
        await conn.execute("INSERT INTO effects VALUES (%s, 'stale')", (ctx.job_id,))
        wrote.set()
        await asyncio.to_thread(finish.wait, 30)
        return "stale"

    job_id = slow.enqueue()
    # Heartbeats far apart, so the ack in the handler's transaction is the first to find out.
    options = {**FAST, "lease": 60.0, "heartbeat_interval": 30.0}
    async with running_worker(app, **options) as worker:
        await asyncio.wait_for(wrote.wait(), 10)
        give_lease_away(effects, job_id)
        finish.set()
        assert worker.state is not None
        state = worker.state
        # Sooner than the next heartbeat (30 s): the ack, not a heartbeat, found the lease gone.
        await wait_until_async(lambda: state.counters.stale_writes == 1, timeout=20)
        assert state.counters.succeeded == 0
    assert effect_rows(effects) == []
    assert job(effects, job_id)[:3] == ("running", 1, None)


def test_a_connection_of_the_wrong_kind_is_refused_at_registration(app: pgqueue.App) -> None:
    with pytest.raises(
        pgqueue.ConfigurationError, match=r"must be annotated psycopg\.AsyncConnection"
    ):

        @app.task
        async def wrong(conn: psycopg.Connection[Any]) -> None: ...

    with pytest.raises(pgqueue.ConfigurationError, match=r"must be annotated psycopg\.Connection$"):

        @app.task
        def wrong_too(conn: psycopg.AsyncConnection[Any]) -> None: ...


async def test_a_transactional_jobs_times_are_its_handlers(app: pgqueue.App, effects: Conn) -> None:
    """finished_at is when the ack was written, not when the handler's transaction began, and
    the handler started after its claim."""

    @app.task
    async def takes_a_second(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, 'slow')", (ctx.job_id,))
        await asyncio.sleep(1.0)

    job_id = takes_a_second.enqueue()
    async with running_worker(app, **FAST):
        await wait_until_async(lambda: job(effects, job_id)[0] == "succeeded")
    row = effects.execute(
        "SELECT extract(epoch FROM finished_at - started_at)::float8,"
        " started_at >= claimed_at, finished_at >= claimed_at + interval '1 second'"
        " FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert row is not None
    ran, started_after_claim, finished_after_the_handler = row
    assert ran >= 0.9 and started_after_claim and finished_after_the_handler, row


async def test_session_settings_of_one_handler_never_reach_the_next(
    app: pgqueue.App, effects: Conn
) -> None:
    """Handler connections are pooled: whatever one handler left on its session (a setting, a
    role, a temporary table, an advisory lock) is reset before the next job gets it."""
    seen: list[tuple[Any, ...]] = []

    @app.task
    def meddles(conn: psycopg.Connection[Any]) -> None:
        conn.execute("SET search_path = pg_catalog")  # session-wide, not LOCAL
        conn.execute("SET statement_timeout = 1234")
        conn.execute("CREATE TEMP TABLE leftovers (x int)")
        conn.execute("SELECT pg_advisory_lock(42)")

    @app.task
    def inspects(conn: psycopg.Connection[Any]) -> None:
        row = conn.execute(
            "SELECT current_setting('search_path'), current_setting('statement_timeout'),"
            " to_regclass('pg_temp.leftovers') IS NULL,"
            " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            "  AND pid = pg_backend_pid())"
        ).fetchone()
        assert row is not None
        seen.append(row)

    first = meddles.enqueue()
    async with running_worker(app, concurrency=1, **FAST):
        await wait_until_async(lambda: job(effects, first)[0] == "succeeded")
        second = inspects.enqueue()
        await wait_until_async(lambda: job(effects, second)[0] == "succeeded")
    assert seen == [('"$user", public', "0", True, 0)]
