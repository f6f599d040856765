"""A worker cut off from the server in the middle of a transaction must not leave it holding
locks for as long as the network takes to say the worker is gone.

The server ends a transaction that waits for its client only through
``idle_in_transaction_session_timeout``, and only once the client's last message was a Sync: a
pipeline whose next statement (or COMMIT) has not come yet keeps the server reading with no
timeout at all, its locks held. Found by the fault suite's blackhole: rows locked by the cut-off
worker were reaped seconds past the recovery bound, and a healthy worker's ack waited on one of
them. Each test cuts a real TCP connection (tests/chaos/proxy.py) at the moment that matters and
watches the locks from another session.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue import db
from pgqueue.jobs import Status
from pgqueue.sql import queries
from pgqueue.worker import fetcher as fetcher_module
from pgqueue.worker.completer import Completer
from pgqueue.worker.executor import Outcome, ack_params
from pgqueue.worker.fetcher import Fetcher
from pgqueue.worker.reaper import Reaper
from pgqueue.worker.scheduler import Scheduler
from pgqueue.worker.state import WorkerState
from pgqueue.worker.transactions import Transactions
from tests.chaos.proxy import BlackholeProxy
from tests.helpers import head_claim, proxied, register_worker, running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


@contextlib.asynccontextmanager
async def one_connection(dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A pool of exactly one connection (the proxy's cut then falls on that one), open."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    )
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close(timeout=1)


def claimed(app: pgqueue.App, conn: Conn, task: str = "t") -> tuple[int, uuid.UUID]:
    """One job enqueued and claimed by a registered worker: its id and lease token."""
    job_id = int(app.enqueue(task, {}, allow_unknown=True))
    worker, token = uuid.uuid4(), uuid.uuid4()
    register_worker(conn, worker)
    rows = conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 1, "token": token, "tasks": None}
    ).fetchall()
    assert [int(r[0]) for r in rows] == [job_id]
    return job_id, token


def row_state(conn: Conn, job_id: int) -> str | None:
    """The job's status if its row can be locked right now, else None (someone holds it)."""
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '50ms'")
            row = conn.execute(
                "SELECT status::text FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (job_id,)
            ).fetchone()
    except psycopg.errors.LockNotAvailable:
        return None
    assert row is not None
    return str(row[0])


async def finish(proxy: BlackholeProxy, task: asyncio.Task[Any]) -> None:
    """Heal the cut and let the cut-off side's call end: it may end either way, but it ends."""
    proxy.heal()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 30)


async def test_acks_that_wake_waiting_workers_commit_with_the_message_that_carried_them(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """The completer's acks of a limited worker carry a wake for the workers waiting on the
    slots they free. Sent as a pipeline (the acks, then the wake, then the Sync), a cut after
    the acks reached the server left them uncommitted and their rows locked for the whole cut;
    now the wake rides in the acks' statement, which commits at once and wakes the waiter."""
    job_id, token = claimed(app, conn)
    outcome = Outcome(job_id, token, Status.SUCCEEDED, None, None, '"ok"', 0.1, "default", 0.0)
    channel = db.channel_for(app.schema)
    with proxied(dsn) as (proxy, through), psycopg.connect(dsn, autocommit=True) as waiting:
        # A waiting worker: it listens and holds the shared lock the wake looks for.
        waiting.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        waiting.execute("SELECT pg_advisory_lock_shared(hashtext(%s), 1)", (channel,))
        async with one_connection(through) as pool:
            completer = Completer(pool, app.q, lambda _batch, _accepted: None)
            completer.wakes = lambda batch: ["default"]
            completer.submit(outcome)
            proxy.cut_after_next_execute()  # the ack gets through, and what travels with it
            write = asyncio.create_task(completer.flush_once())
            try:
                await wait_until_async(
                    lambda: row_state(conn, job_id) == "succeeded",
                    timeout=10,
                    what="the ack committed while its worker is cut off",
                )
                notices = list(waiting.notifies(timeout=10, stop_after=1))
                assert [n.payload for n in notices] == ["default"]
            finally:
                await finish(proxy, write)


async def test_a_handler_transaction_cut_off_after_its_ack_frees_the_jobs_row_within_half_the_lease(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """A handler's own transaction writes the ack last, then COMMIT. A worker cut off between
    the two held the job's row locked for the whole cut (the reaper skips locked rows, so the
    job could not be recovered when its lease ran out). The ack now bounds that wait at half
    the lease: the server ends the session, the ack and the handler's writes roll back, and
    the row is free, still running under the lost lease, for the reaper."""
    job_id, token = claimed(app, conn)
    outcome = Outcome(job_id, token, Status.SUCCEEDED, None, None, '"ok"', 0.1, "default", 0.0)
    with proxied(dsn) as (proxy, through):
        tx = Transactions(through, app.q, size=1, connect_kwargs={}, lock_timeout=4.0)
        params = ack_params([outcome], lock_timeout=tx.lock_timeout, idle=tx.idle_timeout)

        async def handler(c: psycopg.AsyncConnection[Any]) -> None:
            await c.execute("SELECT 1")
            proxy.cut_after_next_execute()  # the ack gets through, COMMIT will not

        run = asyncio.create_task(tx.run_async(handler, lambda result: params))
        try:
            await wait_until_async(
                lambda: row_state(conn, job_id) is None,
                timeout=10,
                what="the ack reached the server and holds the job's row",
            )
            # Free again once the server ended the session (half of a 4 s lease).
            await wait_until_async(
                lambda: row_state(conn, job_id) == "running",
                timeout=10,
                what="the job's row free again, the ack rolled back",
            )
            row = conn.execute(
                "SELECT lease_token FROM pgqueue_jobs WHERE id = %s", (job_id,)
            ).fetchone()
            assert row == (token,)
        finally:
            await finish(proxy, run)
            await tx.close()


@pytest.mark.parametrize("path", ["head", "walk"])
async def test_a_limited_claim_cut_off_while_it_chooses_frees_its_groups_within_the_idle_timeout(
    app: pgqueue.App, conn: Conn, dsn: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The limited claim is two round trips in one transaction: the groups' locks first, then
    the claim. Between them the server waited in the middle of a pipeline, where its idle
    timeout never starts: a worker cut off there kept its groups locked, and every other
    worker's claims out of them, for as long as the cut lasted. The first round trip now ends
    with a Sync, and the session ends after LIMIT_CLAIM_IDLE_MS."""
    monkeypatch.setattr(fetcher_module, "LIMIT_CLAIM_IDLE_MS", "300")
    app.limit_task("keyed", limit=1)
    app.enqueue_many([("keyed", {}), ("keyed", {})], allow_unknown=True)
    worker = uuid.uuid4()
    register_worker(conn, worker)
    claim_statement = {"head": app.q.claim_head_jobs, "walk": app.q.claim_limited_jobs}[path]
    with proxied(dsn) as (proxy, through):
        async with one_connection(through) as pool:
            async with pool.connection() as c:
                execute = c.execute

                async def cut_before_the_claim(query: Any, *args: Any, **kwargs: Any) -> Any:
                    if query == claim_statement:
                        proxy.blackhole()  # the groups are locked; the claim never arrives
                    return await execute(query, *args, **kwargs)

                c.execute = cut_before_the_claim
            fetcher = Fetcher(
                pool,  # psycopg_pool's pool: the worker's acts the same
                queries("public"),
                WorkerState(concurrency=1, prefetch=0),
                worker_id=worker,
                queues=None,
                tasks={"keyed": None},
                poll_interval=60.0,
                start=lambda job: None,
                schema="public",
            )
            claiming = asyncio.create_task(
                fetcher.claim_head(1) if path == "head" else fetcher.claim_walk(1)
            )
            other = uuid.uuid4()
            register_worker(conn, other)
            try:
                await wait_until_async(lambda: proxy.holding, timeout=10, what="the cut")
                # Another worker's claim gets the group once the cut-off claim's session ended.
                await wait_until_async(
                    lambda: bool(head_claim(conn, other, ["keyed"], limit=1)),
                    timeout=10,
                    what="another worker claimed from the group",
                )
            finally:
                await finish(proxy, claiming)


async def test_a_scheduler_cut_off_while_it_fires_leaves_the_tick_to_another_within_its_timeout(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """A scheduler fires a tick in one transaction: it locks the due schedules (SKIP LOCKED, so
    that every worker's scheduler can run at once), inserts their jobs, advances them. Cut off
    after the lock, it held the rows, with no timeout, and every other scheduler skipped the
    schedule: its ticks stopped until the cut ended. The firing transaction's idle timeout (10
    s) now ends the session, and another scheduler fires the tick, once."""
    app.task(name="tick")(lambda: None)
    app.schedule("report", "* * * * *", task="tick")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as direct:
        await Scheduler(app).sync(direct)
        conn.execute(
            "UPDATE pgqueue_schedules SET next_run_at = date_trunc('second', now())"
            " - interval '30 seconds'"
        )
        with proxied(dsn) as (proxy, through):
            async with await psycopg.AsyncConnection.connect(through, autocommit=True) as c:
                execute = c.execute

                async def cut_after_the_lock(query: Any, *args: Any, **kwargs: Any) -> Any:
                    if query == app.q.lock_due_schedules:
                        proxy.cut_after_next_execute()  # the lock arrives, nothing after it
                    return await execute(query, *args, **kwargs)

                c.execute = cut_after_the_lock  # type: ignore[method-assign]
                firing = asyncio.create_task(Scheduler(app).tick(c))
                try:
                    await wait_until_async(lambda: proxy.holding, timeout=10, what="the cut")
                    other = Scheduler(app)
                    await wait_until_async(
                        lambda: other.tick(direct), timeout=30, what="another scheduler fired"
                    )
                finally:
                    await finish(proxy, firing)
    fired = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE schedule_name = 'report'")
    assert fired.fetchall() == [(1,)]


async def test_the_reaper_ends_a_lapsed_workers_sessions_left_inside_a_transaction(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """What no timeout covers (a pipeline's next message, a handler's transaction before its
    ack, the server's default keepalives) is bounded by the lease: a worker whose lease ran out
    is fenced, and the reaper ends its sessions that wait inside a transaction, so the rows
    they hold are reaped. Only those: a live worker's transaction, a lapsed worker's session
    outside any transaction and other applications' sessions are left alone."""
    job_id, _ = claimed(app, conn)
    ((worker,),) = conn.execute(
        "SELECT worker_id FROM pgqueue_jobs WHERE id = %s", (job_id,)
    ).fetchall()
    live = uuid.uuid4()
    register_worker(conn, live)
    conn.execute("UPDATE pgqueue_workers SET lease_expires_at = now() WHERE id = %s", (worker,))

    def session(owner: uuid.UUID | None, role: str = "handler") -> psycopg.Connection[Any]:
        name = "an-application" if owner is None else f"pgqueue-worker:4242:{owner.hex[:16]}:{role}"
        return psycopg.connect(dsn, application_name=name)

    with (
        session(worker) as zombie,
        session(worker, "listen") as idle,
        session(live) as healthy,
        session(None) as other,
    ):
        zombie.execute("SELECT 1 FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (job_id,))
        idle.commit()  # connected, outside any transaction
        healthy.execute("SELECT 1")
        other.execute("SELECT 1")
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        )
        await pool.open()
        reaper = Reaper(
            pool, app.q, WorkerState(concurrency=1), backoff=app.backoff,
            interval=1.0, lease=30.0, retention=None, worker_id=live,
        )  # fmt: skip
        try:
            assert await asyncio.wait_for(reaper.reap(), 10) == 1
        finally:
            await pool.close()
        assert reaper.ended == 1
        assert conn.execute(
            "SELECT status::text FROM pgqueue_jobs WHERE id = %s", (job_id,)
        ).fetchone() == ("retrying",)
        with pytest.raises(psycopg.OperationalError):
            zombie.execute("SELECT 1")
        for survivor in (idle, healthy, other):
            assert survivor.execute("SELECT 1").fetchone() == (1,)


async def test_a_workers_sessions_carry_the_id_the_reaper_looks_for(
    app: pgqueue.App, conn: Conn
) -> None:
    """end_lapsed_sessions finds a worker's sessions by the id in their application_name: every
    session a running worker opens (its pool, its LISTEN, its handlers' transactions) must carry
    it in the form the statement matches."""
    seen: list[str] = []

    @app.task
    async def hold(c: psycopg.AsyncConnection[Any]) -> None:
        cur = await c.execute("SELECT current_setting('application_name')")
        row = await cur.fetchone()
        assert row is not None
        seen.append(str(row[0]))

    async with running_worker(app, concurrency=2, poll_interval=0.2) as worker:
        app.enqueue("hold")
        await wait_until_async(lambda: seen, timeout=30, what="the handler ran")
        rows = conn.execute(
            "SELECT a.application_name FROM pg_stat_activity a JOIN pgqueue_workers w"
            " ON a.application_name LIKE 'pgqueue-worker:%%:'"
            " || left(replace(w.id::text, '-', ''), 16) || ':%%'"
            " WHERE w.id = %s AND a.datname = current_database()",
            (worker.id,),
        ).fetchall()
    roles = {str(name).rsplit(":", 1)[1] for (name,) in rows}
    assert {"pool", "listen"} <= roles
    assert seen[0].startswith("pgqueue-worker:") and seen[0].endswith(
        f":{worker.id.hex[:16]}:handler"
    )
