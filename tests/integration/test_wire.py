"""The single-job INSERT sent straight through libpq (pgqueue/wire.py): the same rows and the
same errors as psycopg's general path, prepared once per connection and again when code that
borrowed the connection deallocated it, and a cancelled or cut-off call never leaves a busy
connection in the pool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import DatabaseUnavailableError
from tests.helpers import wait_until

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
