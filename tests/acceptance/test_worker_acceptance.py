"""Real `pgqueue worker` processes on a real database, with real signals.

Handlers (tests/acceptance/jobs_app.py) record every start in a history table and a trigger
records every state change (tests/history.py), so each test decides in SQL what happened: which
job ran how often, and whether every repeated run followed a lease that had really expired.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pgqueue
from pgqueue.embedded import EmbeddedPostgres, find_bindir
from pgqueue.migrate import migrate
from tests import history
from tests.conftest import Server
from tests.helpers import WorkerProcesses, wait_until

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.jobs_app:app"
Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def workers(dsn: str, conn: Conn, tmp_path: Path) -> Iterator[WorkerProcesses]:
    history.install(conn)
    procs = WorkerProcesses(dsn, APP, tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all(15)
        print(procs.output())  # shown by pytest only when the test failed


def enqueue(app: pgqueue.App, n: int, **args: float) -> list[int]:
    """Queue ``n`` jobs of ``work`` in one COPY; their ids (the newest ``n``)."""
    app.enqueue_many([("work", args) for _ in range(n)], allow_unknown=True)
    with app.connection() as conn:
        rows = conn.execute(
            "SELECT id FROM pgqueue_jobs ORDER BY id DESC LIMIT %s", (n,)
        ).fetchall()
    return sorted(job_id for (job_id,) in rows)


def count(conn: Conn, status: str) -> int:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE status = %s", (status,)).fetchone()
    assert row is not None
    return int(row[0])


def registered(conn: Conn, n: int) -> None:
    wait_until(
        lambda: conn.execute("SELECT count(*) FROM pgqueue_workers").fetchone() == (n,),
        timeout=30,
    )


def running_on(conn: Conn, pid: int) -> list[int]:
    return [
        job_id
        for (job_id,) in conn.execute(
            "SELECT j.id FROM pgqueue_jobs j JOIN pgqueue_workers w ON w.id = j.worker_id"
            " WHERE w.pid = %s AND j.status = 'running'",
            (pid,),
        ).fetchall()
    ]


def started(conn: Conn, job_id: int, attempt: int = 1) -> bool:
    return bool(
        conn.execute(
            "SELECT 1 FROM history_runs WHERE job_id = %s AND attempt = %s AND event = 'start'",
            (job_id, attempt),
        ).fetchone()
    )


def listen_backends(conn: Conn) -> list[int]:
    return [
        pid
        for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'pgqueue-worker:%%:listen'"
        ).fetchall()
    ]


def test_jobs_across_worker_processes_each_succeed_exactly_once(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    for _ in range(3):
        workers.start("--concurrency", "8")
    registered(conn, 3)
    ids = enqueue(app, 300, seconds=0.02)
    wait_until(lambda: count(conn, "succeeded") == 300, timeout=90)

    runs = history.starts(conn)
    assert sorted(runs) == sorted(ids)
    assert [job for job, r in runs.items() if len(r) != 1] == []
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE attempts <> 1").fetchone() == (0,)
    assert len({r[0].pid for r in runs.values()}) >= 2  # the work was shared
    assert conn.execute("SELECT sum(stale_writes) FROM pgqueue_workers").fetchone() == (0,)


def test_sigkill_loses_nothing_and_every_rerun_follows_an_expired_lease(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    victim = workers.start("--concurrency", "6", "--lease", "3")
    workers.start("--concurrency", "6", "--lease", "3")
    registered(conn, 2)
    ids = enqueue(app, 80, seconds=0.4)
    in_flight = wait_until(
        lambda: (found := running_on(conn, victim.pid)) and len(found) >= 3 and found
    )
    victim.kill()
    victim.wait(10)

    wait_until(lambda: count(conn, "succeeded") == 80, timeout=90)
    claims = history.claims(conn)
    assert sorted(claims) == sorted(ids)
    rerun = {job for job, tokens in claims.items() if len(tokens) > 1}
    assert set(in_flight) <= rerun  # everything the victim held ran again...
    assert history.unexplained_duplicates(conn) == []  # ...each after its lease expired
    # What a failing chaos check would print for a re-run job: both claims, the reap between
    # them, and the handler's runs.
    described = "\n".join(history.describe_jobs(conn, [min(rerun)]))
    assert described.count("->running token") == 2, described
    assert "running->retrying" in described and "LeaseExpired" in described, described
    assert "handler start" in described, described
    attempts: dict[int, int] = dict(
        conn.execute("SELECT id, attempts FROM pgqueue_jobs").fetchall()
    )
    assert all(attempts[job] == len(tokens) for job, tokens in claims.items())  # all counted
    runs = history.starts(conn)
    assert all(r.pid == victim.pid for job in rerun for r in runs.get(job, [])[:-1])
    print(f"{len(rerun)} jobs re-run, {history.duplicate_executions(conn)} duplicate executions")


def test_stalled_worker_is_fenced_out_and_abandons_the_job(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    zombie = workers.start("--concurrency", "2", "--lease", "2")
    registered(conn, 1)
    (job,) = enqueue(app, 1, seconds=0.1, first_attempt_seconds=60)
    wait_until(lambda: started(conn, job))
    os.kill(zombie.pid, signal.SIGSTOP)
    workers.start("--concurrency", "2", "--lease", "2")  # the rescuer
    wait_until(lambda: count(conn, "succeeded") == 1, timeout=30)
    final = conn.execute(
        "SELECT status::text, attempts, result, lease_token FROM pgqueue_jobs WHERE id = %s",
        (job,),
    ).fetchone()
    assert final is not None and final[:3] == ("succeeded", 2, 2)

    os.kill(zombie.pid, signal.SIGCONT)
    # The zombie's next heartbeat is refused: it cancels its handler and reports the write.
    wait_until(
        lambda: conn.execute(
            "SELECT 1 FROM history_runs WHERE job_id = %s AND attempt = 1 AND event = 'cancelled'"
            " AND pid = %s",
            (job, zombie.pid),
        ).fetchone(),
        timeout=20,
    )
    wait_until(
        lambda: (
            conn.execute(
                "SELECT stale_writes >= 1 FROM pgqueue_workers WHERE pid = %s", (zombie.pid,)
            ).fetchone()
            == (True,)
        ),
        timeout=20,
    )
    assert (
        conn.execute(
            "SELECT status::text, attempts, result, lease_token FROM pgqueue_jobs WHERE id = %s",
            (job,),
        ).fetchone()
        == final
    )
    first, second = history.claims(conn)[job]
    assert history.ended_by(conn, job, first) == "reaped"
    assert second == final[3]
    assert not conn.execute(
        "SELECT 1 FROM history_runs WHERE job_id = %s AND attempt = 1 AND event = 'done'", (job,)
    ).fetchone()
    # The zombie recovered and takes work again.
    assert zombie.poll() is None
    enqueue(app, 6, seconds=0.01)
    wait_until(lambda: count(conn, "succeeded") == 7, timeout=30)


def test_lost_listen_connection_costs_latency_not_jobs(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses, pg_server: Server
) -> None:
    # Polling once a minute: jobs that finish within seconds were woken otherwise.
    workers.start("--poll-interval", "60")
    registered(conn, 1)
    enqueue(app, 1)  # warms the handlers' own pool before new connections are refused
    wait_until(lambda: count(conn, "succeeded") == 1 and listen_backends(conn), timeout=20)
    (old_listener,) = listen_backends(conn)
    database = sql.Identifier(conn.info.dbname)
    admin = psycopg.connect(pg_server.admin_dsn, autocommit=True)  # not the database it locks
    admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
    try:
        conn.execute("SELECT pg_terminate_backend(%s)", (old_listener,))
        enqueue(app, 1)
        # LISTEN cannot come back while connections are refused, yet the job runs: the
        # notifier's failed reconnects wake the fetcher, which claims on its pooled connection.
        wait_until(lambda: count(conn, "succeeded") == 2, timeout=30)
        assert listen_backends(conn) == []
    finally:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        admin.close()
    wait_until(lambda: listen_backends(conn), timeout=30)
    assert listen_backends(conn) != [old_listener]
    for n in range(3, 6):  # one at a time: with a 60 s poll, only NOTIFY can be this quick
        enqueue(app, 1)
        wait_until(lambda: count(conn, "succeeded") == n, timeout=10)  # noqa: B023


def test_sigterm_lets_running_jobs_finish_and_exits_zero(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    worker = workers.start("--concurrency", "4", "--grace-period", "30")
    registered(conn, 1)
    ids = enqueue(app, 8, seconds=1.0)
    # Started, not merely claimed: a claimed job may still wait in the buffer for its slot, and
    # those are released at SIGTERM, not run.
    wait_until(lambda: sum(started(conn, job) for job in ids) == 4)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    statuses: dict[str, int] = dict(
        conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1").fetchall()
    )
    assert statuses == {"succeeded": 4, "queued": 4}  # finished in grace, acks flushed
    assert conn.execute("SELECT count(*) FROM pgqueue_workers").fetchone() == (0,)


def test_sigterm_past_the_grace_period_releases_jobs_for_others_at_once(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    first = workers.start("--concurrency", "2", "--grace-period", "0.5", "--lease", "120")
    registered(conn, 1)
    ids = enqueue(app, 2, seconds=3600)
    wait_until(lambda: all(started(conn, job) for job in ids))
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    rows = conn.execute(
        "SELECT status::text, attempts, lease_expires_at, worker_id, run_at <= now()"
        " FROM pgqueue_jobs ORDER BY id"
    ).fetchall()
    assert rows == [("queued", 0, None, None, True)] * 2  # the attempt is not counted
    cancelled = conn.execute(
        "SELECT count(*) FROM history_runs WHERE event = 'cancelled' AND pid = %s", (first.pid,)
    ).fetchone()
    assert cancelled == (2,)
    # Another worker takes them now, long before their 120 s lease could have expired.
    second = workers.start("--concurrency", "2", "--lease", "120")
    wait_until(lambda: len(running_on(conn, second.pid)) == 2, timeout=30)


def test_a_second_signal_exits_at_once(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    worker = workers.start("--grace-period", "600", "--log-level", "INFO")
    registered(conn, 1)
    (job,) = enqueue(app, 1, seconds=3600)
    wait_until(lambda: started(conn, job))
    worker.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: no new claims" in workers.output())
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 1  # without waiting out the 600 s grace period


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, since the test restarts it."""
    if find_bindir() is None:
        pytest.skip("restarting PostgreSQL needs its server binaries (initdb, pg_ctl)")
    with EmbeddedPostgres() as cluster:
        yield cluster


def test_workers_survive_a_postgresql_crash_restart(
    own_cluster: EmbeddedPostgres, tmp_path: Path
) -> None:
    dsn = own_cluster.dsn
    with psycopg.connect(dsn, autocommit=True) as setup:
        migrate(setup, "public")
        history.install(setup)
    procs = WorkerProcesses(dsn, APP, tmp_path)
    app = pgqueue.App(dsn)
    try:
        for _ in range(2):
            procs.start("--concurrency", "5", "--lease", "10")  # a restart under load: 3-4 s
        with psycopg.connect(dsn, autocommit=True) as conn:
            registered(conn, 2)
            enqueue(app, 400, seconds=0.05)
            wait_until(lambda: count(conn, "succeeded") >= 60, timeout=60)
        app.close()

        own_cluster.restart("immediate")  # a crash: no checkpoint, every connection cut

        app = pgqueue.App(dsn)
        enqueue(app, 50, seconds=0.05)  # producers and NOTIFY work again too
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(lambda: count(conn, "succeeded") == 450, timeout=120)
            assert all(proc.poll() is None for proc in procs.procs)
            assert history.unexplained_duplicates(conn, failures_explain=True) == []
            assert conn.execute(
                "SELECT count(*) FROM pgqueue_jobs WHERE attempts > max_attempts"
            ).fetchone() == (0,)
        procs.stop_all(30)
        assert "fenced stale write" not in procs.output()  # every ack's fate was known
    finally:
        app.close()
        procs.stop_all(15)
        print(procs.output())
