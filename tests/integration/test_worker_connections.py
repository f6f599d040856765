"""The worker's connection budget (pgqueue.worker.connections): a small constant whatever the
concurrency, and a server that refuses connections (53300) never stops a worker."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

import pgqueue
from pgqueue.worker.connections import WorkerPool, budget, share
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 0.2, "reaper_interval": 1.0}


def worker_backends(conn: Conn) -> int:
    """This process's worker connections (in-process workers name them by our pid)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s"
        " AND datname = current_database()",
        (f"pgqueue-worker:{os.getpid()}:%",),
    ).fetchone()
    assert row is not None
    return int(row[0])


def active_queries(conn: Conn, marker: str) -> int:
    """Statements running now whose text carries ``/* marker */``."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE %s AND state = 'active'",
        (f"%/* {marker} */%",),
    ).fetchone()
    assert row is not None
    return int(row[0])


def succeeded(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def limited_role(dsn: str, conn: Conn) -> Iterator[tuple[str, str]]:
    """A role allowed one connection (CONNECTION LIMIT 1: the server answers a second with
    53300, as it does when max_connections is reached) that may use pgqueue's tables; its DSN
    and name."""
    name = f"fleet_{uuid.uuid4().hex[:10]}"
    role = sql.Identifier(name)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 1").format(role))
    for grant in (
        "GRANT USAGE ON SCHEMA public TO {}",
        "GRANT ALL ON ALL TABLES IN SCHEMA public TO {}",
        "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {}",
    ):
        conn.execute(sql.SQL(grant).format(role))
    try:
        yield conninfo.make_conninfo(dsn, user=name), name
    finally:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        conn.execute(sql.SQL("DROP ROLE {}").format(role))


async def test_a_worker_holds_at_most_its_connections_whatever_its_concurrency(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task
    async def nap() -> None:
        await asyncio.sleep(0.02)

    app.enqueue_many([("nap", {}) for _ in range(600)])
    seen = 0
    async with running_worker(app, concurrency=50, **FAST) as worker:
        while succeeded(conn) < 600:
            seen = max(seen, worker_backends(conn))
            await asyncio.sleep(0.02)
        assert worker.pool.peak <= 5
    assert 1 <= seen <= 5  # one each for claims, acks, heartbeats and maintenance, and LISTEN


async def test_a_worker_allowed_one_connection_by_the_server_polls_and_works(
    limited_role: tuple[str, str], app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """Every connection beyond the first is refused with 53300: the worker says so once, polls
    instead of listening, runs every job on its one connection, and keeps its lease."""
    role_dsn, _ = limited_role
    worker_app = pgqueue.App(role_dsn)

    @worker_app.task
    async def nap() -> None:
        await asyncio.sleep(0.01)

    app.enqueue_many([("nap", {}) for _ in range(200)], allow_unknown=True)
    with caplog.at_level(logging.INFO, logger="pgqueue.worker"):
        async with running_worker(worker_app, concurrency=10, **FAST) as worker:
            await wait_until_async(lambda: succeeded(conn) == 200, timeout=60)
            beats = worker.heartbeat.beats
            await wait_until_async(lambda: worker.heartbeat.beats >= beats + 2, timeout=30)
            assert worker.pool.held == 1
            assert not worker.notifier.listening.is_set()
    worker_app.close()
    refused = [r.getMessage() for r in caplog.records if "53300" in r.getMessage()]
    assert refused and len(refused) <= 2, refused  # the pool's line, the notifier's line
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE attempts <> 1").fetchone()
    assert row == (0,)


async def test_a_worker_started_when_the_server_has_no_slot_waits_for_one(
    limited_role: tuple[str, str], app: pgqueue.App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    role_dsn, _ = limited_role
    holder = psycopg.connect(role_dsn, autocommit=True)  # the role's only slot
    worker_app = pgqueue.App(role_dsn)

    @worker_app.task
    async def nap() -> None:
        pass

    worker = worker_app.worker(install_signal_handlers=False, **FAST)
    with caplog.at_level(logging.WARNING, logger="pgqueue.worker"):
        task = asyncio.create_task(worker.run())
        try:
            await wait_until_async(
                lambda: "no connection slot left" in caplog.text or task.done(), timeout=30
            )
            assert not task.done()
            holder.close()
            await wait_until_async(lambda: worker.started.is_set() or task.done(), timeout=30)
            assert not task.done()
            app.enqueue_many([("nap", {}) for _ in range(5)], allow_unknown=True)
            await wait_until_async(lambda: succeeded(conn) == 5, timeout=30)
        finally:
            holder.close()
            worker.stop()
            await asyncio.wait_for(task, 60)
            worker_app.close()


def test_the_fleet_takes_its_share_of_the_server_and_each_worker_at_least_one() -> None:
    # PostgreSQL's defaults: 100 connections, 3 of them for superusers.
    assert share(100, 3, 1) == 77
    assert share(100, 3, 10) == 7
    assert share(100, 3, 38) == 2
    assert share(100, 3, 39) == 1
    assert share(100, 3, 50) == 1
    assert share(100, 3, 500) == 1
    assert all(share(100, 3, n) * n <= 77 for n in range(1, 78))


def test_a_worker_grows_no_further_while_the_server_is_nearly_full() -> None:
    # Five workers counted so far (a fleet still starting): a share of 15, unless the server's
    # client connections already fill 80 % of its 97 slots.
    assert budget(100, 3, 5, in_use=40, held=2) == 15
    assert budget(100, 3, 5, in_use=78, held=2) == 2
    assert budget(100, 3, 5, in_use=90, held=1) == 1
    assert budget(100, 3, 50, in_use=20, held=3) == 1  # the share still rules


async def test_handlers_that_enqueue_use_at_most_the_apps_pool_size(dsn: str, conn: Conn) -> None:
    app = pgqueue.App(dsn, pool_size=2)

    @app.task
    async def child() -> None:
        pass

    @app.task
    async def parent() -> None:
        await child.enqueue_async()
        await asyncio.sleep(0.01)

    @app.task
    def sync_parent() -> None:
        child.enqueue()

    app.enqueue_many(
        [("parent", {}) for _ in range(150)] + [("sync_parent", {}) for _ in range(150)]
    )
    seen = 0
    try:
        async with running_worker(app, concurrency=30, **FAST):
            while succeeded(conn) < 600:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                    " AND datname = current_database()",
                    ("pgqueue-producer",),
                ).fetchone()
                assert row is not None
                seen = max(seen, int(row[0]))
                await asyncio.sleep(0.02)
    finally:
        app.close()
    assert 1 <= seen <= 4  # 2 for the sync handlers' enqueues, 2 for the worker loop's


async def test_the_heartbeat_gets_the_next_free_connection_before_other_lanes(dsn: str) -> None:
    """With one connection for every lane, a heartbeat that asks after a claim is served
    first: a lease must not wait behind a queue of other work."""
    pool = WorkerPool(dsn, {"autocommit": True}, size=1)
    order: list[str] = []

    async def use(lane: str) -> None:
        async with pool.connection(lane) as conn:
            order.append(lane)
            await conn.execute("SELECT 1")

    try:
        async with pool.connection("maintenance"):
            claims = asyncio.create_task(use("claims"))
            await wait_until_async(lambda: len(pool._waiters) == 1)
            heartbeat = asyncio.create_task(use("heartbeat"))
            await wait_until_async(lambda: len(pool._waiters) == 2)
        await asyncio.gather(claims, heartbeat)
        assert order == ["heartbeat", "claims"]
        assert pool.peak == 1
    finally:
        await pool.close()


async def test_a_look_beside_the_claims_ends_with_the_worker_that_started_it(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetcher's look at the next due job, run beside the claims (slow while vacuum is held
    back), is cancelled when the worker stops, and its query with it, before run() returns: left
    to finish on its own, it outlived the worker, and the event loop's close cancelled it a
    second time in the middle of psycopg's cancellation ("query cancellation interrupted")."""
    from pgqueue.worker.fetcher import Fetcher

    quick_look = Fetcher.next_due_in

    async def slow_look(self: Fetcher, pool: Any = None) -> float | None:
        if asyncio.current_task() is not self._look:  # the claim loop's own looks
            return await quick_look(self, pool)
        # On a connection of its own: on the claims' lane it would hold up the claims too.
        async with await psycopg.AsyncConnection.connect(dsn) as c:
            await c.execute("SELECT pg_sleep(60) /* slow look */")
        return None

    monkeypatch.setattr(Fetcher, "next_due_in", slow_look)
    app = pgqueue.App(dsn)

    try:
        async with running_worker(app, **FAST) as worker:
            fetcher = worker.fetcher
            fetcher._look_beside(asyncio.get_running_loop())
            look = fetcher._look
            assert look is not None
            await wait_until_async(lambda: active_queries(conn, "slow look") == 1, timeout=30)
        # run() has returned: nothing of the worker is left running.
        assert look.done()
        assert active_queries(conn, "slow look") == 0
    finally:
        await app.aclose()


async def test_background_rounds_end_before_the_worker_returns(
    dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake (or an announcement) still on its way when the worker stops gets a moment, then
    is cancelled and waited for: run() returns with none of them left running."""
    from pgqueue.worker.runtime import Worker

    async def slow_wake(self: Worker, queues: list[str]) -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as c:
            await c.execute("SELECT pg_sleep(60) /* slow wake */")

    monkeypatch.setattr(Worker, "_wake", slow_wake)
    app = pgqueue.App(dsn)

    try:
        async with running_worker(app, **FAST) as worker:
            worker.wake(["default"])
            [wake] = worker._wakes
            await wait_until_async(lambda: active_queries(conn, "slow wake") == 1, timeout=30)
        assert wake.done()
        assert active_queries(conn, "slow wake") == 0
    finally:
        await app.aclose()
