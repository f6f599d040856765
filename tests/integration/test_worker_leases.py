"""Leases, fencing, the reaper, heartbeats and LISTEN recovery, on a real database.

The statement-level tests drive the worker's own named statements by hand, so each race is set
up exactly; the in-process tests show the runtime reacting to it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue import db
from pgqueue.jobs import Status
from pgqueue.worker.completer import Completer
from pgqueue.worker.executor import Outcome
from tests.helpers import (
    db_clock,
    give_lease_away,
    register_worker,
    running_worker,
    wait_until_async,
)

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}
BACKOFF = {"backoff_base": 1.0, "backoff_cap": 3600.0, "pause": 0.0}


def claim(app: pgqueue.App, conn: Conn, worker: uuid.UUID, lease: float = 30) -> list[Any]:
    """Claimed rows as the fetcher sees them: the claim's token in place 6, before the pickup.
    The worker registers first (or renews its lease): claims need a live worker lease."""
    register_worker(conn, worker, lease)
    token = uuid.uuid4()
    rows = conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 10, "token": token, "tasks": None}
    ).fetchall()
    return [(*r[:6], token, r[6]) for r in rows]


def claimed_successes(app: pgqueue.App, conn: Conn, count: int) -> tuple[list[int], list[Outcome]]:
    """``count`` jobs enqueued and claimed, and the successful outcome of each, as a worker's
    handlers would hand them to the completer."""
    ids = [int(app.enqueue("t", {}, allow_unknown=True)) for _ in range(count)]
    outcomes = [
        Outcome(job_id, token, Status.SUCCEEDED, None, None, '"ok"', 0.1, "default", 0.0)
        for job_id, *_, token, _ in claim(app, conn, uuid.uuid4())
    ]
    return ids, outcomes


def complete(app: pgqueue.App, conn: Conn, job_id: int, token: uuid.UUID) -> list[Any]:
    """The ids the ack was written for (its second column, whether anyone waits for results,
    is not this module's business)."""
    return [
        row[:1]
        for row in conn.execute(
            app.q.complete_jobs,
            {
                "lock_timeout": "100ms",
                "ids": [job_id],
                "tokens": [token],
                "statuses": ["succeeded"],
                "delays": [0.0],
                "errors": [None],
                "results": ['"late"'],
                "run_seconds": [0.1],
            },
        ).fetchall()
    ]


def expire(conn: Conn, job_id: int) -> None:
    conn.execute(
        "UPDATE pgqueue_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (job_id,),
    )


def row(conn: Conn, job_id: int) -> tuple[Any, ...]:
    found = conn.execute(
        "SELECT status::text, attempts, lease_token, worker_id, result, last_error"
        " FROM pgqueue_jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert found is not None
    return found


def test_stale_worker_cannot_complete_reclaimed_job(app: pgqueue.App, conn: Conn) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    worker_a, worker_b = uuid.uuid4(), uuid.uuid4()
    ((_, *_, token_a, _),) = claim(app, conn, worker_a)
    expire(conn, job_id)
    reaped = conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall()
    assert reaped == [(job_id, "retrying", 1, "default")]
    conn.execute("UPDATE pgqueue_jobs SET run_at = now() WHERE id = %s", (job_id,))
    ((_, *_, token_b, _),) = claim(app, conn, worker_b)
    assert token_b != token_a

    # Every write of the stalled holder A changes nothing.
    assert complete(app, conn, job_id, token_a) == []
    extend = {"worker_id": worker_a, "host": "h", "pid": 1, "queues": None, "concurrency": 1}
    extend |= {"stale_writes": 0, "lease": 30, "ids": [job_id], "tokens": [token_a]}
    assert conn.execute(app.q.extend_leases, extend).fetchall() == [
        (job_id, token_a, False)
    ]  # lost
    release = {"ids": [job_id], "tokens": [token_a]}
    assert conn.execute(app.q.release_leases, release).fetchall() == []
    assert row(conn, job_id)[:4] == ("running", 2, token_b, worker_b)

    # The current holder's ack is accepted.
    assert complete(app, conn, job_id, token_b) == [(job_id,)]
    assert row(conn, job_id)[:2] == ("succeeded", 2)


def test_reaper_counts_the_attempt_and_buries_jobs_out_of_attempts(
    app: pgqueue.App, conn: Conn
) -> None:
    last_try = app.enqueue("t", {}, max_attempts=1, allow_unknown=True)
    more = app.enqueue("t", {}, max_attempts=3, allow_unknown=True)
    claim(app, conn, uuid.uuid4())
    expire(conn, last_try)
    expire(conn, more)
    before = db_clock(conn)
    reaped = sorted(conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall())
    after = db_clock(conn)
    assert reaped == [(last_try, "dead", 1, "default"), (more, "retrying", 1, "default")]
    status, attempts, token, worker, _, error = row(conn, last_try)
    assert (status, attempts, token, worker) == ("dead", 1, None, None)
    assert error.startswith("LeaseExpired: worker ")
    due = conn.execute(
        "SELECT extract(epoch FROM run_at)::float8 FROM pgqueue_jobs WHERE id = %s", (more,)
    ).fetchone()
    assert due is not None and before <= due[0] <= after + 1.0  # uniform(0, base) after attempt 1


def test_reaper_leaves_a_live_lease_and_a_job_being_completed_alone(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    live = app.enqueue("t", {}, allow_unknown=True)
    finishing = app.enqueue("t", {}, allow_unknown=True)
    tokens = {r[0]: r[6] for r in claim(app, conn, uuid.uuid4())}
    expire(conn, finishing)
    with psycopg.connect(dsn) as completing:
        # The holder's ack is in flight (row locked, not yet committed) when the reaper runs:
        # it skips that row instead of waiting for it, and leaves the live lease alone.
        assert complete(app, completing, finishing, tokens[finishing]) == [(finishing,)]
        with psycopg.connect(dsn, autocommit=True) as reaper:
            assert reaper.execute(app.q.reap_expired_leases, BACKOFF).fetchall() == []
        completing.commit()
    assert row(conn, finishing)[:2] == ("succeeded", 1)
    assert row(conn, live)[:3] == ("running", 1, tokens[live])
    # Once its ack committed there is nothing left to reap.
    assert conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall() == []


def test_a_job_is_reaped_when_its_worker_lease_runs_out_or_its_worker_is_gone(
    app: pgqueue.App, conn: Conn
) -> None:
    """A claimed job's lease is its worker's: it lapses with the worker's row (no heartbeat) or
    at once when the worker deregistered without handing the job back."""
    lapsed, gone = uuid.uuid4(), uuid.uuid4()
    first = app.enqueue("t", {}, allow_unknown=True)
    ((job_a, *_),) = claim(app, conn, lapsed)
    second = app.enqueue("t", {}, allow_unknown=True)
    ((job_b, *_),) = claim(app, conn, gone)
    assert (job_a, job_b) == (first, second)
    assert conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall() == []
    conn.execute(
        "UPDATE pgqueue_workers SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (lapsed,),
    )
    conn.execute(app.q.deregister_worker, {"worker_id": gone})
    reaped = sorted(conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall())
    assert [(r[0], r[1]) for r in reaped] == [(first, "retrying"), (second, "retrying")]


def test_a_worker_whose_lease_ran_out_claims_nothing(app: pgqueue.App, conn: Conn) -> None:
    worker = uuid.uuid4()
    app.enqueue("t", {}, allow_unknown=True)
    register_worker(conn, worker, lease=30)
    conn.execute(
        "UPDATE pgqueue_workers SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (worker,),
    )
    params = {"worker_id": worker, "limit": 10, "token": uuid.uuid4(), "tasks": None}
    assert conn.execute(app.q.claim_jobs, params).fetchall() == []
    register_worker(conn, worker, lease=30)  # a heartbeat renews it
    assert len(conn.execute(app.q.claim_jobs, params).fetchall()) == 1


async def test_ack_whose_commit_went_unseen_is_recognised_not_counted_stale(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    ((_, *_, token, _),) = claim(app, conn, uuid.uuid4())
    written: list[set[int]] = []
    outcome = Outcome(job_id, token, Status.SUCCEEDED, None, None, '"ok"', 0.1, "default", 0.0)
    async with AsyncConnectionPool(
        dsn, min_size=1, open=False, kwargs={"autocommit": True}
    ) as pool:
        completer = Completer(pool, app.q, lambda _batch, accepted: written.append(accepted))
        completer.submit(outcome)
        await completer.flush_once()
        assert written == [{job_id}]
        # The same ack again, as after a write whose COMMIT reached the server but whose reply
        # was lost: the row already carries our token, so it is ours, not a stale write.
        completer._uncertain = True
        completer.submit(outcome)
        await completer.flush_once()
        assert written[-1] == {job_id}
        # Without that doubt a repeated ack is refused like any stale write.
        completer.submit(outcome)
        await completer.flush_once()
        assert written[-1] == set()
    assert row(conn, job_id)[:3] == ("succeeded", 1, token)


async def test_heartbeat_that_finds_the_lease_gone_cancels_the_handler(
    app: pgqueue.App, conn: Conn
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    @app.task
    async def long_running() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    job_id = long_running.enqueue()
    async with running_worker(app, **FAST) as worker:
        await asyncio.wait_for(started.wait(), 10)
        give_lease_away(conn, job_id)
        await asyncio.wait_for(cancelled.wait(), 10)
        assert worker.state is not None
        assert worker.state.counters.stale_writes == 1
        # The next heartbeat reports the refused write on the worker's row.
        await wait_until_async(
            lambda: (
                conn.execute(
                    "SELECT stale_writes FROM pgqueue_workers WHERE id = %s", (worker.id,)
                ).fetchone()
                == (1,)
            )
        )
    status, attempts, *_ = row(conn, job_id)
    assert (status, attempts) == ("running", 1)  # untouched: it belongs to the other holder


async def test_late_result_of_a_lost_lease_is_refused_and_counted(
    app: pgqueue.App, conn: Conn
) -> None:
    started, finish = asyncio.Event(), asyncio.Event()

    @app.task
    async def slow() -> str:
        started.set()
        await finish.wait()
        return "stale"

    job_id = slow.enqueue()
    # Heartbeats far apart, so the ack is the first write to meet the new holder's token.
    options = {**FAST, "lease": 60.0, "heartbeat_interval": 30.0}
    async with running_worker(app, **options) as worker:
        await asyncio.wait_for(started.wait(), 10)
        new_token = give_lease_away(conn, job_id)
        finish.set()
        assert worker.state is not None
        state = worker.state
        # Sooner than the next heartbeat (30 s): the ack, not a heartbeat, found the lease gone.
        await wait_until_async(lambda: state.counters.stale_writes == 1, timeout=20)
        assert state.counters.succeeded == 0
        assert not any(key[0] == job_id for key in state.held)
    assert row(conn, job_id)[:3] == ("running", 1, new_token)
    assert row(conn, job_id)[4] is None


async def test_acks_are_batched_many_per_statement(app: pgqueue.App, conn: Conn) -> None:
    @app.task
    async def instant() -> None:
        return None

    app.enqueue_many([("instant", {}) for _ in range(300)])
    async with running_worker(app, concurrency=50, **FAST) as worker:
        await wait_until_async(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'"
                ).fetchone()
                == (300,)
            ),
            timeout=30,
        )
        writes = worker.completer.writes
    assert writes <= 300 / 3, f"{writes} ack statements for 300 jobs"


async def test_listen_comes_back_after_its_connection_is_killed(
    app: pgqueue.App, conn: Conn
) -> None:
    done: list[int] = []

    @app.task
    async def ping(n: int) -> None:
        done.append(n)

    # Polling once a minute: a job finishing within seconds was woken by NOTIFY.
    options = {**FAST, "poll_interval": 60.0}
    async with running_worker(app, **options) as worker:
        await wait_until_async(worker.notifier.listening.is_set)
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'pgqueue-worker:%%:listen' AND datname = current_database()"
        ).fetchall()
        assert killed == [(True,)]
        await wait_until_async(lambda: worker.notifier.reconnects >= 1)
        await wait_until_async(worker.notifier.listening.is_set)
        for n in range(3):
            ping.enqueue(n=n)
            await wait_until_async(lambda: len(done) == n + 1, timeout=10)  # noqa: B023


async def test_heartbeat_survives_an_unexpected_error(
    app: pgqueue.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgqueue.worker.heartbeat import Heartbeat

    real_beat = Heartbeat.beat
    calls = 0

    async def flaky_beat(self: Heartbeat) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise MemoryError("a handler is hogging memory")
        await real_beat(self)

    monkeypatch.setattr(Heartbeat, "beat", flaky_beat)
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(lambda: worker.heartbeat.beats >= 3)


async def test_a_service_that_ends_stops_the_worker_with_an_error(
    app: pgqueue.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgqueue.worker.reaper import Reaper

    async def gone(self: Reaper, stopping: asyncio.Event) -> None:
        return None

    monkeypatch.setattr(Reaper, "run", gone)
    worker = app.worker(install_signal_handlers=False, **FAST)
    with pytest.raises(pgqueue.PgQueueError, match="its reaper service ended unexpectedly"):
        await asyncio.wait_for(worker.run(), 30)


async def test_a_stalled_ack_holds_up_no_other_reaping(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """A worker stopped between its ack and its COMMIT (SIGSTOP, a cut network) keeps that row
    locked. The reaper does not wait for it: it reaps every other expired lease around it at
    once and leaves the locked row to its holder, whose fenced ack may still commit."""
    from pgqueue.worker.reaper import Reaper
    from pgqueue.worker.state import WorkerState

    stuck = app.enqueue("t", {}, allow_unknown=True)
    others = [app.enqueue("t", {}, allow_unknown=True) for _ in range(3)]
    tokens = {r[0]: r[6] for r in claim(app, conn, uuid.uuid4())}
    for job_id in [stuck, *others]:
        expire(conn, job_id)
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    )
    await pool.open()
    reaper = Reaper(
        pool, app.q, WorkerState(concurrency=1), backoff=app.backoff,
        interval=1.0, lease=30.0, retention=None,
    )  # fmt: skip
    try:
        with psycopg.connect(dsn) as holder:
            assert complete(app, holder, stuck, tokens[stuck]) == [(stuck,)]  # not committed
            assert await asyncio.wait_for(reaper.reap(), 10) == 3
            assert [row(conn, j)[0] for j in others] == ["retrying"] * 3
            holder.commit()
        assert row(conn, stuck)[:2] == ("succeeded", 1)
        assert await reaper.reap() == 0
    finally:
        await pool.close()


async def test_a_lost_attempt_counts_once_even_if_its_ack_is_also_refused(
    app: pgqueue.App, conn: Conn
) -> None:
    """The heartbeat finds the lease gone and cancels the handler, which finishes anyway (it
    swallows the cancellation), so its ack is sent and refused too: one lost attempt, one stale
    write, in the counters and in the dashboard's statistics."""
    started, finish = asyncio.Event(), asyncio.Event()

    @app.task(queue="lostonce")
    async def stubborn() -> str:
        started.set()
        try:
            await finish.wait()
        except asyncio.CancelledError:
            await finish.wait()
        return "late"

    job_id = stubborn.enqueue()
    options = {**FAST, "lease": 60.0, "heartbeat_interval": 30.0}
    async with running_worker(app, **options) as worker:
        await asyncio.wait_for(started.wait(), 10)
        give_lease_away(conn, job_id)
        await worker.heartbeat.beat()  # finds the lease gone: counted, handler cancelled
        finish.set()
        state = worker.state
        assert state is not None
        await wait_until_async(lambda: not any(key[0] == job_id for key in state.held))
        assert state.counters.stale_writes == 1

        def lost() -> int:
            found = conn.execute(
                "SELECT coalesce(sum(lost), 0)::int FROM pgqueue_stats WHERE queue = 'lostonce'"
            ).fetchone()
            return int(found[0]) if found else 0

        await wait_until_async(lambda: lost() >= 1)
    assert lost() == 1


async def test_a_long_prune_does_not_hold_back_reaping(
    app: pgqueue.App, conn: Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune works through its batches for up to PRUNE_BUDGET seconds (a day of history to
    delete). Reaping goes on beside it on the same maintenance lane, waiting for one batch at
    most, so a crashed worker's job is claimable again within lease + reaper interval, not
    after the prune."""
    from pgqueue.worker import reaper as reaper_module
    from pgqueue.worker.connections import WorkerPool
    from pgqueue.worker.reaper import Reaper
    from pgqueue.worker.state import WorkerState

    monkeypatch.setattr(reaper_module, "PRUNE_BUDGET", 120.0)
    history = 20_000
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at)"
        " SELECT 'history', 't', 'succeeded', 1, now() - interval '2 days'"
        " FROM generate_series(1, %s)",
        (history,),
    )

    def left() -> int:
        found = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE queue = 'history'")
        return int(found.fetchone()[0])  # type: ignore[index]

    job_id = app.enqueue("t", {}, allow_unknown=True)
    claim(app, conn, uuid.uuid4())
    pool = WorkerPool(dsn, {"autocommit": True}, size=4)
    reaper = Reaper(
        pool.lane("maintenance"), app.q, WorkerState(concurrency=1), backoff=app.backoff,
        interval=0.1, lease=30.0, retention=86400.0, batch=1,
    )  # fmt: skip
    stopping = asyncio.Event()
    running = asyncio.create_task(reaper.run(stopping))
    try:
        await wait_until_async(lambda: left() < history - 50, timeout=30)  # pruning, one by one
        expire(conn, job_id)
        await wait_until_async(lambda: row(conn, job_id)[0] == "retrying", timeout=10)
        assert left() > 0, "the prune ended first: the test proved nothing"
    finally:
        stopping.set()
        await asyncio.wait_for(running, 30)
        await pool.close()


async def test_acks_wait_for_company_only_while_a_handler_may_give_some(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """The writer waited the whole flush interval for more acks even when the last running
    handler had just ended: with a limit equal to the concurrency, every slot waits for those
    acks, so each claim-run-ack cycle lost the interval (here an hour: the old code hangs)."""
    ids, outcomes = claimed_successes(app, conn, 2)
    written: list[set[int]] = []
    running = 2
    async with AsyncConnectionPool(
        dsn, min_size=1, open=False, kwargs={"autocommit": True}
    ) as pool:
        completer = Completer(
            pool, app.q, lambda _batch, accepted: written.append(accepted), flush_interval=3600
        )
        completer.idle = lambda: running == 0
        stopping = asyncio.Event()
        writer = asyncio.create_task(completer.run(stopping))
        running = 1
        completer.submit(outcomes[0])  # one handler still runs: wait for its ack
        await wait_until_async(lambda: completer._company is not None)  # it waits for company
        assert written == []
        running = 0
        completer.submit(outcomes[1])  # the last one ended: no company can come
        await wait_until_async(lambda: written == [set(ids)], timeout=10)
        stopping.set()
        completer.stop()
        await asyncio.wait_for(writer, 10)


async def test_the_wake_for_freed_slots_rides_in_the_acks_transaction(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """Acks that free limit slots wake waiting workers in their own transaction: the NOTIFY
    comes from the ack's connection as the acks commit (no round trip of its own), and a write
    that failed sends none (the runtime's separate wake covers what ``woke`` leaves out)."""
    channel = db.channel_for(app.schema)
    ids, outcomes = claimed_successes(app, conn, 2)
    written: list[set[int]] = []
    pids: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as waiting, psycopg.connect(dsn) as locker:
        # A waiting worker: it listens and holds the shared lock the wake looks for.
        waiting.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        waiting.execute("SELECT pg_advisory_lock_shared(hashtext(%s), 1)", (channel,))
        async with AsyncConnectionPool(
            dsn, min_size=1, open=False, kwargs={"autocommit": True}
        ) as pool:
            completer = Completer(pool, app.q, lambda _b, accepted: written.append(accepted))
            completer.wakes = lambda batch: ["default"]
            completer.own_pid = pids.append
            completer.submit(outcomes[0])
            await completer.flush_once()
            assert written == [{ids[0]}] and completer.woke == {"default"}
            (notice,) = list(waiting.notifies(timeout=10, stop_after=1))
            assert (notice.payload, notice.pid) == ("default", pids[0])
            # A row locked by someone else fails the first write: nothing is sent with it, and
            # the write around the lock says it woke nobody.
            locker.execute("SELECT 1 FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (ids[1],))
            completer.submit(outcomes[1])
            await completer.flush_once()
            assert written == [{ids[0]}] and [o for o, _, _ in completer.busy] == [outcomes[1]]
            assert completer.woke == frozenset()
            assert list(waiting.notifies(timeout=0.5, stop_after=1)) == []
            locker.rollback()
