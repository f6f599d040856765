"""One slow or locked job costs only itself: leases survive outside locks, slow commits, stalls
and handlers' own transactions at any isolation level.

The worker's lease is one row of its own (migration 0005), so its heartbeat never touches, waits
on or conflicts with a job's row; acks wait on a locked row only briefly and then write around
it. Each test here reproduces a way the per-job heartbeat of earlier versions lost leases of
healthy jobs (see issue 17) and checks that nothing runs twice.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.jobs import Status
from pgqueue.worker.executor import Outcome
from pgqueue.worker.state import ClaimedJob, Held, Phase
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}


def job_states(conn: Conn, ids: Sequence[int]) -> dict[int, tuple[str, int]]:
    rows = conn.execute(
        "SELECT id, status::text, attempts FROM pgqueue_jobs WHERE id = ANY(%s)", (ids,)
    ).fetchall()
    return {int(r[0]): (str(r[1]), int(r[2])) for r in rows}


def all_succeeded_once(conn: Conn, ids: Sequence[int]) -> bool:
    return set(job_states(conn, ids).values()) == {("succeeded", 1)}


async def test_a_row_locked_by_someone_else_costs_only_that_row(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """An operator's session holds SELECT ... FOR UPDATE on one running job for several leases.
    The worker goes on: heartbeats land, other jobs are claimed, run and acked, none is reaped;
    the locked job's ack waits aside and lands when the lock goes."""
    release = threading.Event()
    runs: dict[int, int] = {}

    @app.task
    def blocker() -> str:
        release.wait(30)
        return "done"

    @app.task
    async def quick(n: int) -> int:
        runs[n] = runs.get(n, 0) + 1
        await asyncio.sleep(0.05)
        return n

    blocked = blocker.enqueue()
    async with running_worker(app, concurrency=10, **FAST) as worker:
        await wait_until_async(lambda: job_states(conn, [blocked])[blocked][0] == "running")
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT * FROM pgqueue_jobs WHERE id = %s FOR UPDATE", (blocked,))
            release.set()  # its handler finishes; its ack meets the lock
            beats = worker.heartbeat.beats
            ids = [quick.enqueue(n=n) for n in range(60)]
            await wait_until_async(lambda: all_succeeded_once(conn, ids), timeout=30)
            # Three leases with the lock held, and the worker still keeps its lease.
            deadline = time.monotonic() + 3 * FAST["lease"]
            await wait_until_async(lambda: time.monotonic() >= deadline, timeout=10)
            assert worker.heartbeat.beats >= beats + 4
            assert job_states(conn, [blocked])[blocked] == ("running", 1)
            more = [quick.enqueue(n=n) for n in range(60, 80)]
            await wait_until_async(lambda: all_succeeded_once(conn, more), timeout=30)
            operator.rollback()
        await wait_until_async(lambda: job_states(conn, [blocked])[blocked] == ("succeeded", 1))
        assert worker.state is not None
        assert worker.state.counters.stale_writes == 0
    assert set(runs.values()) == {1}


@pytest.fixture
def slow_commits(conn: Conn) -> Iterator[str]:
    """A table whose inserts make COMMIT take seconds (a deferred constraint trigger)."""
    conn.execute("CREATE TABLE slow_effects (job_id bigint)")
    conn.execute(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN PERFORM pg_sleep(5); RETURN NULL; END$$"
    )
    conn.execute(
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_effects"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()"
    )
    yield "slow_effects"


async def test_a_slow_transactional_commit_costs_no_other_lease(
    app: pgqueue.App, conn: Conn, slow_commits: str
) -> None:
    """A handler's transaction holds its job's row from its ack to its COMMIT, here 5 s (more
    than two leases). The heartbeat never waits on that row, so the worker's other long jobs
    keep their leases and run once."""
    starts: dict[str, int] = {}

    @app.task
    async def committing(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any]) -> None:
        starts["committing"] = starts.get("committing", 0) + 1
        await conn.execute("INSERT INTO slow_effects VALUES (%s)", (ctx.job_id,))

    @app.task
    async def innocent(n: int) -> None:
        key = f"innocent-{n}"
        starts[key] = starts.get(key, 0) + 1
        await asyncio.sleep(7)

    ids = [innocent.enqueue(n=n) for n in range(3)]
    slow = committing.enqueue()
    async with running_worker(app, concurrency=5, **FAST) as worker:
        await wait_until_async(lambda: all_succeeded_once(conn, [*ids, slow]), timeout=40)
        assert worker.state is not None
        assert worker.state.counters.stale_writes == 0
    assert starts == {"committing": 1, "innocent-0": 1, "innocent-1": 1, "innocent-2": 1}
    assert conn.execute("SELECT count(*) FROM slow_effects").fetchone() == (1,)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
async def test_transactional_handlers_work_at_every_isolation_level(
    app: pgqueue.App, conn: Conn, isolation: str
) -> None:
    """The handler's snapshot is taken before several heartbeats pass; its ack must not
    conflict with anything the worker wrote meanwhile (nothing writes a running job's row)."""
    conn.execute("CREATE TABLE iso_effects (job_id bigint PRIMARY KEY, seen bigint)")

    @app.task(max_attempts=1)
    async def careful(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        cur = await conn.execute("SELECT count(*) FROM iso_effects")  # the snapshot is taken
        (seen,) = await cur.fetchone() or (0,)
        await asyncio.sleep(2.0)  # four heartbeats
        await conn.execute("INSERT INTO iso_effects VALUES (%s, %s)", (ctx.job_id, seen))

    ids = [careful.enqueue() for _ in range(2)]
    # One at a time: concurrent SERIALIZABLE handlers reading and writing the same table would
    # fail each other (the user's own conflict), which is not what this test is about.
    async with running_worker(app, concurrency=1, **FAST) as worker:
        await wait_until_async(lambda: worker.heartbeat.beats >= 1)
        await wait_until_async(
            lambda: all(
                s != "running" and s != "queued" for s, _ in job_states(conn, ids).values()
            ),
            timeout=20,
        )
    assert job_states(conn, ids) == {i: ("succeeded", 1) for i in ids}
    assert conn.execute("SELECT count(*) FROM iso_effects").fetchone() == (2,)


async def test_a_heartbeat_never_waits_on_a_job_row(app: pgqueue.App, conn: Conn, dsn: str) -> None:
    """Heartbeats only read job rows: a lock on one (an operator's, or an ack's on its way to
    its COMMIT) delays no heartbeat, so heartbeats and acks can never deadlock either."""
    release = asyncio.Event()

    @app.task
    async def held() -> None:
        await release.wait()

    ids = [held.enqueue() for _ in range(5)]
    async with running_worker(app, concurrency=5, **FAST) as worker:
        await wait_until_async(
            lambda: {s for s, _ in job_states(conn, ids).values()} == {"running"}
        )
        with psycopg.connect(dsn) as operator:
            operator.execute(
                "SELECT * FROM pgqueue_jobs WHERE id = ANY(%s) ORDER BY id DESC FOR UPDATE",
                (ids,),
            )
            started = time.monotonic()
            await asyncio.wait_for(worker.heartbeat.beat(), 5)
            assert time.monotonic() - started < 2
            operator.rollback()
        release.set()
        await wait_until_async(lambda: all_succeeded_once(conn, ids))


def test_acks_heartbeats_reaps_and_releases_never_deadlock(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """Every pgqueue statement that writes many job rows either takes them in ascending id order
    (acks), skips rows locked by someone else (reaper, release) or does not lock them at all
    (heartbeat). Run them all at once over the same rows, each update slowed down, in orders
    chosen to cross: no deadlock is ever detected."""
    conn.execute(
        "CREATE FUNCTION slow_row() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN PERFORM pg_sleep(0.005); RETURN NEW; END$$"
    )
    conn.execute(
        "CREATE TRIGGER slow_row BEFORE UPDATE ON pgqueue_jobs FOR EACH ROW"
        " EXECUTE FUNCTION slow_row()"
    )
    from tests.helpers import register_worker

    worker = uuid.uuid4()
    register_worker(conn, worker)
    app.enqueue_many([("t", {}) for _ in range(60)], allow_unknown=True)
    token = uuid.uuid4()
    claimed = conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 60, "token": token, "tasks": None}
    ).fetchall()
    ids = sorted(int(r[0]) for r in claimed)
    errors: list[BaseException] = []

    def hammer(statement: bytes, params: dict[str, Any], rounds: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                for _ in range(rounds):
                    c.execute(statement, params).fetchall()
        except BaseException as exc:
            errors.append(exc)

    extend = {"worker_id": worker, "host": "h", "pid": 1, "queues": None, "concurrency": 1,
              "stale_writes": 0, "lease": 30.0, "ids": ids[::-1], "tokens": [token] * 60}  # fmt: skip
    # Acks that wait as long as it takes: this is about deadlocks, not the completer's bound.
    acks: dict[str, Any] = {
        "lock_timeout": "60s", "ids": ids, "tokens": [token] * 60, "statuses": ["retrying"] * 60,
        "delays": [0.0] * 60, "errors": ["e"] * 60, "results": [None] * 60,
        "run_seconds": [0.0] * 60,
    }  # fmt: skip
    reap = {"backoff_base": 1.0, "backoff_cap": 1.0, "pause": 0.0}
    # Half of them with an expired lease of their own, so the reaper takes rows too.
    conn.execute(
        "UPDATE pgqueue_jobs SET lease_expires_at = now() - interval '1 second' WHERE id % 2 = 0"
    )
    threads = [
        threading.Thread(target=hammer, args=(app.q.extend_leases, extend, 30)),
        threading.Thread(target=hammer, args=(app.q.complete_jobs, acks, 3)),
        threading.Thread(target=hammer, args=(app.q.complete_jobs, acks, 3)),
        threading.Thread(target=hammer, args=(app.q.reap_expired_leases, reap, 30)),
        threading.Thread(
            target=hammer, args=(app.q.release_leases, {"ids": ids, "tokens": [token] * 60}, 3)
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


async def test_a_refused_ack_of_one_attempt_leaves_the_next_attempt_of_the_same_job_alone(
    app: pgqueue.App, conn: Conn
) -> None:
    """After a stall longer than the lease and a reap elsewhere, the same worker can claim
    attempt N+1 of a job while attempt N's ack is still on its way. N's refusal must not touch
    N+1, which is tracked under its own lease token: it runs and is acked."""
    ran = asyncio.Event()

    @app.task(queue="reclaimed")
    async def twice() -> str:
        ran.set()
        return "second"

    job_id = twice.enqueue()
    # The worker serves another queue: this test feeds it the job by hand, in this order.
    async with running_worker(app, queues=["elsewhere"], **FAST) as worker:
        state = worker.state
        assert state is not None
        first_token, second_token = uuid.uuid4(), uuid.uuid4()
        first = ClaimedJob(job_id, "reclaimed", "twice", {}, 1, 5, first_token, 0.0)
        attempt_n = Held(first, phase=Phase.ACKING)
        state.held[first.key] = attempt_n
        # Attempt N+1: claimed for real by this worker, with a new token.
        conn.execute(
            app.q.claim_jobs,
            {"worker_id": worker.id, "limit": 1, "token": second_token, "tasks": None},
        ).fetchall()
        worker._start(ClaimedJob(job_id, "reclaimed", "twice", {}, 1, 5, second_token, 0.0))
        # Attempt N's ack comes back refused, before N+1 has even started.
        refused = Outcome(job_id, first_token, Status.SUCCEEDED, None, None, None, 1.0,
                          "reclaimed", 0.0)  # fmt: skip
        worker._on_written([refused], set())
        await asyncio.wait_for(ran.wait(), 10)
        await wait_until_async(lambda: job_states(conn, [job_id])[job_id][0] == "succeeded")
        # The ack's commit is visible a moment before the worker hears back from it.
        await wait_until_async(lambda: not state.held, timeout=10)


async def test_the_lease_deadline_a_handler_sees_moves_with_heartbeats(
    app: pgqueue.App, conn: Conn
) -> None:
    seen: list[float] = []
    heartbeats = asyncio.Event()

    @app.task
    async def watches(ctx: pgqueue.JobContext) -> None:
        seen.append(ctx.lease_deadline)
        await heartbeats.wait()
        seen.append(ctx.lease_deadline)

    job_id = watches.enqueue()
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(lambda: len(seen) == 1)
        beats = worker.heartbeat.beats
        await wait_until_async(lambda: worker.heartbeat.beats >= beats + 2)
        heartbeats.set()
        await wait_until_async(lambda: job_states(conn, [job_id])[job_id][0] == "succeeded")
    first, later = seen
    assert later > first + 0.5 * FAST["heartbeat_interval"]
    assert later <= time.time() + FAST["lease"]


async def test_a_handler_of_a_worker_cut_off_from_the_database_stops_at_its_lease_deadline(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    """Heartbeats stop landing (here: the worker's own row is locked, so they time out). The
    handler is cancelled when the worker's lease runs out on the worker's clock, which is before
    the database's expiry, so before any reaper can hand the job to another worker."""
    cancelled_at: list[float] = []
    started = asyncio.Event()

    @app.task
    async def long_job() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled_at.append(time.time())
            raise

    # Heartbeats far apart: the worker's lease runs out between two of them.
    options = {**FAST, "lease": 3.0, "heartbeat_interval": 2.5}
    job_id = long_job.enqueue()
    async with running_worker(app, **options) as worker:
        await asyncio.wait_for(started.wait(), 10)
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT * FROM pgqueue_workers WHERE id = %s FOR UPDATE", (worker.id,))
            row = operator.execute(
                "SELECT extract(epoch FROM lease_expires_at) FROM pgqueue_workers WHERE id = %s",
                (worker.id,),
            ).fetchone()
            assert row is not None
            expiry = float(row[0])
            await wait_until_async(lambda: bool(cancelled_at), timeout=15)
            operator.rollback()
        # Cancelled no later than the lease's end in the database (plus the loop's latency),
        # not at the next heartbeat's attempt, which may come a whole interval later.
        assert cancelled_at[0] <= expiry + 1.0, (cancelled_at[0], expiry)
        await wait_until_async(lambda: job_states(conn, [job_id])[job_id][0] != "running")
