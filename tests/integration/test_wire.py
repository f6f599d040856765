"""The single-job INSERT sent straight through libpq (pgqueue/wire.py): the same rows and the
same errors as psycopg's general path, prepared once per connection and again when code that
borrowed the connection deallocated it, and a cancelled or cut-off call never leaves a busy
connection in the pool. The loop's reader on a pooled connection's socket (wire._Watcher)
outlives one call: it never reads another user's answer, lets go of a connection the server
ended or another thread closed, and never outlives its loop."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import DatabaseUnavailableError, wire
from tests.helpers import wait_until, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]

ROW = (
    "SELECT queue, task, args, priority, max_attempts, limit_key, meta, status::text,"
    " extract(epoch FROM run_at - created_at) > 0.5, run_at FROM pgqueue_jobs WHERE id = %s"
)
WAITERS = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
)


def waiting(conn: Conn, *, terminate: bool = False) -> bool:
    """Whether a session waits on a lock (terminated if asked). The activity view is read
    afresh: inside a transaction it would otherwise keep its first reading."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    query = (
        WAITERS.replace("SELECT pid", "SELECT pg_terminate_backend(pid)") if terminate else WAITERS
    )
    return bool(conn.execute(query).fetchall())


@pytest.fixture
def general(dsn: str) -> Iterator[pgqueue.App]:
    """An app that never prepares statements, so every enqueue takes psycopg's general path."""
    application = pgqueue.App(dsn, prepared_statements=False)
    try:
        yield application
    finally:
        application.close()


def prepared(app: pgqueue.App) -> list[str]:
    with app.connection() as c:
        rows = c.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgqueue_insert_job_%'"
        ).fetchall()
    return [r[0] for r in rows]


CALLS: list[dict[str, Any]] = [
    {"args": {"n": 1, "text": "é ✓ \\ ' \"", "nested": {"a": [1, 2.5, None, True]}}},
    {"args": {}, "priority": -5, "max_attempts": 1, "queue": "mail"},
    {"args": {"n": 2}, "delay": 1.5},
    {"args": {"n": 3}, "delay": timedelta(minutes=2), "meta": {"trace": "abc", "n": 1}},
    {"args": {"n": 4}, "run_at": datetime(2031, 2, 3, 4, 5, 6, 789, tzinfo=timezone(timedelta(hours=-7)))},
    {"args": {"n": 5}, "priority": 2**31 - 1, "max_attempts": 2**31 - 1},
]  # fmt: skip


def rows(conn: Conn, ids: list[int]) -> list[tuple[Any, ...]]:
    return [conn.execute(ROW, (i,)).fetchone() or () for i in ids]


def test_the_direct_insert_writes_what_the_general_one_does(
    app: pgqueue.App, general: pgqueue.App, conn: Conn
) -> None:
    @app.task(limit=2, limit_key=lambda args: f"tenant-{args.get('n')}")
    def limited(**args: Any) -> None: ...

    general.task(limit=2, limit_key=lambda args: f"tenant-{args.get('n')}")(limited.func)

    direct = [int(app.enqueue("limited", **call)) for call in CALLS]
    plain = [int(general.enqueue("limited", **call)) for call in CALLS]
    assert prepared(app) and not prepared(general)

    async def both() -> tuple[list[int], list[int]]:
        a = [int(await app.enqueue_async("limited", **call)) for call in CALLS]
        g = [int(await general.enqueue_async("limited", **call)) for call in CALLS]
        return a, g

    direct_async, plain_async = asyncio.run(both())
    got, expected = rows(conn, direct + direct_async), rows(conn, plain + plain_async)
    assert [r[:-1] for r in got] == [r[:-1] for r in expected]
    # An absolute run_at is kept to the microsecond, whatever its offset.
    assert got[4][-1] == CALLS[4]["run_at"] == expected[4][-1]
    assert got[0][5] == "tenant-1" and got[1][5] == "tenant-None"


def _unique_story(app: pgqueue.App, conn: Conn, tag: str) -> list[Any]:
    """The same unique enqueues on ``app``: what each answered, and the jobs' arguments."""

    def call(key: str, n: int, **options: Any) -> pgqueue.Enqueued:
        return app.enqueue("u", {"n": n}, unique_key=f"{tag}-{key}", allow_unknown=True, **options)

    def finish(job: int) -> None:
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now() WHERE id = %s",
            (job,),
        )

    first = call("a", 1)
    answers: list[Any] = [(first.duplicate, first.replaced)]
    again = call("a", 2)  # keep: the first job, untouched
    replaced = call("a", 3, on_conflict="replace")
    answers += [(j == first, j.duplicate, j.replaced) for j in (again, replaced)]
    waiting = call("b", 1, unique_while="waiting")
    finish(waiting)
    after = call("b", 2, unique_while="waiting")  # its key is released, a new job
    kept = call("c", 1, unique_for=3600)
    finish(kept)
    within = asyncio.run(
        app.enqueue_async("u", {"n": 2}, unique_key=f"{tag}-c", unique_for=3600, allow_unknown=True)
    )
    answers += [(after == waiting, after.duplicate), (within == kept, within.duplicate)]
    answers += [conn.execute("SELECT args FROM pgqueue_jobs WHERE id = %s", (j,)).fetchone()
                for j in (first, waiting, after, kept)]  # fmt: skip
    return answers


def test_a_unique_job_takes_the_direct_path_with_the_general_paths_answers(
    app: pgqueue.App, general: pgqueue.App, conn: Conn
) -> None:
    """Unique enqueues went through psycopg's general path (a quarter of an async call's CPU
    more than a plain one); the direct path answers as it did: duplicates, replacements, keys
    released by finished jobs."""
    assert _unique_story(app, conn, "direct") == _unique_story(general, conn, "general")
    with app.connection() as c:
        names = c.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE 'pgqueue_insert_unique_job_%'"
        ).fetchall()
    assert names, "the unique insert did not take the direct path"
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (8,)


def test_it_is_prepared_once_per_connection_and_again_after_a_deallocate(
    app: pgqueue.App, conn: Conn
) -> None:
    first = app.enqueue("t", {}, allow_unknown=True)
    (name,) = prepared(app)
    with app.connection() as borrowed:
        borrowed.execute("DEALLOCATE ALL")
    second = app.enqueue("t", {}, allow_unknown=True)
    assert second > first and prepared(app) == [name]

    async def on_a_loop() -> int:
        await app.enqueue_async("t", {}, allow_unknown=True)
        pool = await app._async_pool()  # what a coroutine borrowing the loop's connection does
        borrowed = await pool.take()
        await borrowed.execute("DEALLOCATE ALL")
        pool.give_back(borrowed)
        return await app.enqueue_async("t", {}, allow_unknown=True)

    assert asyncio.run(on_a_loop()) > second
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (4,)


def test_errors_are_the_general_paths(dsn: str, conn: Conn) -> None:
    conn.execute("CREATE SCHEMA empty_one")
    for prepare in (True, False):
        with pgqueue.App(dsn, schema="empty_one", prepared_statements=prepare) as app:
            with pytest.raises(psycopg.errors.UndefinedTable, match="pgqueue_jobs"):
                app.enqueue("t", {}, allow_unknown=True)
            with pytest.raises(psycopg.errors.UndefinedTable, match="pgqueue_jobs"):
                asyncio.run(app.enqueue_async("t", {}, allow_unknown=True))


def test_a_cancelled_async_enqueue_leaves_no_busy_connection_in_the_pool(
    app: pgqueue.App, conn: Conn
) -> None:
    async def scenario() -> int:
        await app.enqueue_async("t", {}, allow_unknown=True)
        with conn.transaction():
            conn.execute("LOCK TABLE pgqueue_jobs IN ACCESS EXCLUSIVE MODE")
            call = asyncio.ensure_future(app.enqueue_async("t", {}, allow_unknown=True))
            while not waiting(conn):
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        # The busy connection was closed, not reused: the next call gets an answer.
        return await asyncio.wait_for(app.enqueue_async("t", {}, allow_unknown=True), 30)

    assert asyncio.run(scenario()) > 0


def test_an_async_write_whose_connection_dies_mid_statement_is_not_retried(
    app: pgqueue.App, conn: Conn
) -> None:
    failure: list[BaseException] = []

    async def enqueue() -> None:
        try:
            await app.enqueue_async("t", {}, allow_unknown=True)
        except BaseException as exc:
            failure.append(exc)

    with conn.transaction():
        conn.execute("LOCK TABLE pgqueue_jobs IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=asyncio.run, args=(enqueue(),))
        thread.start()
        wait_until(lambda: waiting(conn, terminate=True), what="the enqueue waiting on the lock")
        thread.join(10)
        assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], DatabaseUnavailableError)
    assert str(failure[0]).endswith("the write may or may not have been applied")
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


def test_a_name_the_general_path_refuses_is_refused_the_same(app: pgqueue.App) -> None:
    """NUL never reaches libpq (its text parameters would end there): refused before."""
    with pytest.raises(pgqueue.InvalidJobError, match="NUL"):
        app.enqueue("t\x00x", {}, allow_unknown=True)
    assert app.enqueue("t", {}, allow_unknown=True) > 0


# --- the reader kept on a pooled connection's socket between calls ------------------------------

needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc/self/fd"
)
PRODUCERS = (
    "SELECT {} FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def baseline() -> int:
    """The descriptors before a scenario, once an earlier test's garbage is gone: a watcher
    whose loop ended closes its copy of the socket when it is collected, which could otherwise
    happen halfway through the count."""
    gc.collect()
    return descriptors()


def producers(conn: Conn, *, terminate: bool = False) -> int:
    what = "pg_terminate_backend(pid)" if terminate else "pid"
    return len(conn.execute(PRODUCERS.format(what)).fetchall())


@needs_proc
def test_a_statement_through_psycopg_on_a_watched_connection_gets_its_answer(
    app: pgqueue.App,
) -> None:
    """The watcher sees that answer arrive too: it lets go without reading it (psycopg's own
    wait would otherwise never hear of it), and the next enqueue watches the socket again."""

    async def scenario() -> None:
        before = baseline()
        first = await app.enqueue_async("t", {}, allow_unknown=True)
        assert descriptors() == before + 2  # the connection's socket and the watcher's copy
        pool = await app._async_pool()
        borrowed = await pool.take()  # the connection the enqueue used and watches
        cursor = await asyncio.wait_for(borrowed.execute("SELECT 42"), 30)
        assert await cursor.fetchone() == (42,)
        pool.give_back(borrowed)
        await wait_until_async(lambda: descriptors() == before + 1)
        assert await app.enqueue_async("t", {}, allow_unknown=True) > first
        assert descriptors() == before + 2

    asyncio.run(scenario())


@needs_proc
def test_a_watched_connection_the_server_ends_while_idle_is_let_go(
    app: pgqueue.App, conn: Conn
) -> None:
    """Its socket stays readable (the goodbye, then the end of the stream): the watcher stops
    watching it at once rather than waking the loop forever, and the next call goes to a fresh
    connection."""

    async def scenario() -> None:
        before = baseline()
        await app.enqueue_async("t", {}, allow_unknown=True)
        assert producers(conn, terminate=True) == 1
        wait_until(lambda: producers(conn) == 0, what="the producer's session gone")
        await wait_until_async(lambda: descriptors() == before + 1)
        assert await asyncio.wait_for(app.enqueue_async("t", {}, allow_unknown=True), 30) > 0
        assert descriptors() == before + 2

    asyncio.run(scenario())
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (2,)


@needs_proc
def test_closing_the_app_from_another_thread_ends_a_watched_connection(
    app: pgqueue.App, conn: Conn
) -> None:
    """``App.close()`` may run in any thread: the session ends at once, and the loop's watcher
    lets go of the socket's copy when it hears of it, in the loop's own thread."""

    async def scenario() -> None:
        before = baseline()
        await app.enqueue_async("t", {}, allow_unknown=True)
        closer = threading.Thread(target=app.close)
        closer.start()
        closer.join(30)
        wait_until(lambda: producers(conn) == 0, what="the producer's session gone")
        await wait_until_async(lambda: descriptors() == before)
        assert await asyncio.wait_for(app.enqueue_async("t", {}, allow_unknown=True), 30) > 0
        assert descriptors() == before + 2 and producers(conn) == 1

    asyncio.run(scenario())


@needs_proc
def test_a_watcher_does_not_outlive_its_loop(dsn: str, conn: Conn) -> None:
    """A connection whose reader was on a loop that has closed is watched afresh on the next
    loop, and the old copy of its socket is closed."""
    statement = wire.statement(pgqueue.App(dsn).q.insert_job)
    params: list[bytes | None] = [b"default", b"t", b"{}", b"0", None, b"0.0", b"1", None, None]
    before = baseline()
    aconn = asyncio.run(psycopg.AsyncConnection.connect(dsn, autocommit=True))
    try:
        first = asyncio.run(asyncio.wait_for(wire.insert_async(aconn, statement, params), 30))
        second = asyncio.run(asyncio.wait_for(wire.insert_async(aconn, statement, params), 30))
        assert second > first
        assert descriptors() == before + 2
    finally:
        aconn.pgconn.finish()
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (2,)


@needs_proc
def test_a_call_cancelled_after_its_answer_was_read_leaves_no_busy_connection(
    app: pgqueue.App, conn: Conn
) -> None:
    """The watcher reads the answer in its callback; a cancellation that lands before the call
    resumes leaves the results unfetched on the connection: the pool closes it, the watcher
    lets go of its socket, and the next call gets a fresh connection. The job was committed,
    as with any call cancelled once its statement was sent."""

    async def scenario() -> None:
        before = baseline()
        await app.enqueue_async("t", {}, allow_unknown=True)
        pool = await app._async_pool()
        borrowed = await pool.take()  # the connection the next call will use, and its watcher
        pool.give_back(borrowed)
        session = wire._sessions[borrowed.pgconn]
        call = asyncio.ensure_future(app.enqueue_async("t", {}, allow_unknown=True))
        # The callback that reads the answer runs after this coroutine in a pass of the loop,
        # and wakes the call in the next pass, after this coroutine again.
        deadline = asyncio.get_running_loop().time() + 30
        while not (session.watcher and session.watcher.waiter and session.watcher.waiter.done()):
            assert asyncio.get_running_loop().time() < deadline, "no answer read"
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert borrowed.closed
        await wait_until_async(lambda: descriptors() == before)
        assert await asyncio.wait_for(app.enqueue_async("t", {}, allow_unknown=True), 30) > 0

    asyncio.run(scenario())
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (3,)
