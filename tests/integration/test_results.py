"""Waiting for a job's result (App.wait, App.wait_async), on a real database with real workers.

A waiter is woken by the worker's announcement of the job's end; with workers that poll once a
minute and a waiter that looks on its own every few seconds, an answer within a second or so
can only have come from the announcement.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

import pgqueue
from pgqueue import db, results
from pgqueue.worker.executor import Outcome, ack_params
from tests.helpers import running_worker, wait_until, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
NO_POLL = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}


@pytest.fixture(autouse=True)
def slow_own_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters look on their own once a minute here: an answer in seconds was announced."""
    monkeypatch.setattr(results, "LOOK_EVERY", 60.0)


#: The advisory lock the tests' triggers hold an ack on until the test lets go.
HOLD = 4242


def ack_held(conn: Conn) -> bool:
    """An ack waits in a test trigger for HOLD."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted",
        (HOLD,),
    ).fetchone()
    return row == (1,)


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


@pytest.mark.parametrize(
    ("kind", "isolation"),
    [("async", None), ("sync", None), ("async", "repeatable read"), ("sync", "serializable")],
)
async def test_a_waiter_arriving_while_the_ack_commits_is_answered_at_once(
    app: pgqueue.App,
    conn: Conn,
    dsn: str,
    kind: str,
    isolation: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ack that looked for waiters just before this one announced itself, and commits just
    after this one first looked at the job, sends no announcement: the waiter's first look
    waits for that commit instead of finding the job still running and sleeping until its own
    next look (regression: the CI saw a waiter sleep through its whole timeout). Under a
    stricter default isolation (the waiter's DSN's) that wait ends in a serialization failure,
    which says the same: the ack committed (not a lost connection to connect again for)."""
    reconnections: list[BaseException] = []
    pause = results._Reconnect.pause

    def counted(self: Any, exc: BaseException) -> float:
        reconnections.append(exc)
        return pause(self, exc)

    monkeypatch.setattr(results._Reconnect, "pause", counted)
    # Test-only: the ack of this job waits, after its look for waiters, until the test lets go.
    conn.execute(
        "CREATE FUNCTION held_ack() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " PERFORM set_config('lock_timeout', '0', true);"
        f" PERFORM pg_advisory_xact_lock_shared({HOLD}); RETURN NULL; END $$"
    )
    conn.execute(
        "CREATE TRIGGER held_ack AFTER UPDATE ON pgqueue_jobs FOR EACH ROW"
        " WHEN (OLD.status = 'running' AND NEW.status = 'succeeded') EXECUTE FUNCTION held_ack()"
    )
    conn.execute("SELECT pg_advisory_lock(%s)", (HOLD,))

    @app.task
    async def quick() -> str:
        return "done"

    job = quick.enqueue()
    # The waiter's session (the only one without an application name besides ``conn``) has
    # announced itself and has looked at the job: it is either waiting for a row lock or idle
    # after reading the job.
    waiter_looked = (
        "SELECT a.wait_event_type = 'Lock' OR (a.state = 'idle' AND a.query LIKE '%%pgqueue_jobs%%')"
        " FROM pg_stat_activity a WHERE a.datname = current_database() AND a.application_name = ''"
        " AND a.pid <> pg_backend_pid() AND EXISTS (SELECT FROM pg_locks l WHERE l.pid = a.pid"
        " AND l.locktype = 'advisory' AND l.objid = 3 AND l.objsubid = 2 AND l.granted)"
    )
    escaped = None if isolation is None else isolation.replace(" ", "\\ ")
    options = None if escaped is None else f"-c default_transaction_isolation={escaped}"
    waiting = pgqueue.App(conninfo.make_conninfo(dsn, options=options))
    try:
        async with running_worker(app, **NO_POLL):
            await wait_until_async(lambda: ack_held(conn), what="ack held")
            if kind == "async":
                waiter = asyncio.ensure_future(waiting.wait_async(job, timeout=60))
            else:
                waiter = asyncio.ensure_future(asyncio.to_thread(waiting.wait, job, 60))
            await wait_until_async(
                lambda: (conn.execute(waiter_looked).fetchone() or (False,))[0],
                what="waiter looked",
            )
            conn.execute("SELECT pg_advisory_unlock(%s)", (HOLD,))
            started = time.monotonic()
            assert await asyncio.wait_for(waiter, 15) == "done"
            assert time.monotonic() - started < 5
            assert reconnections == []
    finally:
        waiting.close()


def test_an_ack_looks_for_waiters_only_once_its_whole_batch_is_locked(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """The ack's look for waiters comes after every row of its batch is written and locked: a
    waiter that announces itself while the batch is still being written is seen (and then
    announced to), and one that comes after the look finds the rows locked (the test above).
    Here a waiter arrives between the batch's first and second row (regression: the look was
    made at the first row and this waiter was not told)."""
    first, second = (app.enqueue("quick", {"n": n}, allow_unknown=True) for n in range(2))
    tokens = {first: uuid.uuid4(), second: uuid.uuid4()}
    for job_id, token in tokens.items():
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'running', attempts = 1, claimed_at = now(),"
            " lease_token = %s, lease_expires_at = now() + interval '1 minute' WHERE id = %s",
            (token, job_id),
        )
    # Test-only: the ack stops before its second row until the test lets go.
    conn.execute(
        "CREATE FUNCTION second_row_held() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF current_setting('test.first_row_done', true) = 'yes' THEN"
        "   PERFORM set_config('lock_timeout', '0', true);"
        f"   PERFORM pg_advisory_xact_lock_shared({HOLD});"
        " ELSE PERFORM set_config('test.first_row_done', 'yes', true); END IF;"
        " RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER second_row_held BEFORE UPDATE ON pgqueue_jobs FOR EACH ROW"
        " WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION second_row_held()"
    )
    conn.execute("SELECT pg_advisory_lock(%s)", (HOLD,))
    batch = [
        Outcome(job_id, token, pgqueue.Status.SUCCEEDED, None, None, None, 0.0, "default", 0.0)
        for job_id, token in tokens.items()
    ]
    written: list[Any] = []
    with psycopg.connect(dsn, autocommit=True) as acker, psycopg.connect(dsn) as waiter:
        ack = threading.Thread(
            target=lambda: written.extend(
                acker.execute(app.q.complete_jobs, ack_params(batch)).fetchall()
            )
        )
        ack.start()
        try:
            wait_until(lambda: ack_held(conn), what="the ack held before its second row")
            waiter.execute(app.q.announce_result_wait)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (HOLD,))
            ack.join(30)
    assert sorted(written) == [(first, True), (second, True)]


def test_a_waiters_first_look_gives_up_on_a_held_row_or_a_role_that_may_not_lock_it(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """The first look's wait for the job's row is bounded (here by the wait's own timeout) and
    needs UPDATE on the jobs table; past the bound, or without the privilege, the waiter reads
    the job all the same."""
    job = app.enqueue("done_by_hand", {}, allow_unknown=True)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', result = '42', finished_at = now()"
        " WHERE id = %s",
        (job,),
    )
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (job,))
        assert app.wait(job, timeout=0.5) == 42  # the row stays locked throughout
    name = f"reader_{uuid.uuid4().hex[:10]}"
    role = sql.Identifier(name)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
    try:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
        conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(role))
        reader = pgqueue.App(conninfo.make_conninfo(dsn, user=name))
        try:
            assert reader.wait(job, timeout=30) == 42
        finally:
            reader.close()
    finally:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        conn.execute(sql.SQL("DROP ROLE {}").format(role))
