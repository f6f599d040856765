"""Limits across real `pgqueue worker` processes, through SIGKILL and SIGSTOP.

The trigger of tests/history.py logs every status change with the database clock; a job holds a
slot of its limit from the change into 'running' to the change out of it. These tests replay
that log to find the most leases a group ever held at once, and check that a killed or stalled
worker's slot comes back (by the reaper, once its lease expired) and never earlier.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgqueue
from tests import history
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


def most_leases_at_once(conn: Conn) -> dict[str, int]:
    """Per limit group (task, key): the most jobs 'running' at any moment, from the log."""
    rows = conn.execute(
        "SELECT j.task || '/' || COALESCE(j.limit_key, '-'),"
        " CASE WHEN t.new_status = 'running' THEN 1 ELSE -1 END"
        " FROM history_transitions t JOIN pgqueue_jobs j ON j.id = t.job_id"
        " WHERE (t.new_status = 'running') <> (t.old_status = 'running')"
        " ORDER BY t.at, t.seq"
    ).fetchall()
    now: dict[str, int] = {}
    peak: dict[str, int] = {}
    for group, step in rows:
        now[group] = now.get(group, 0) + step
        peak[group] = max(peak.get(group, 0), now[group])
    return peak


def registered(conn: Conn, n: int) -> None:
    wait_until(
        lambda: conn.execute("SELECT count(*) FROM pgqueue_workers").fetchone() == (n,),
        timeout=30,
    )


def statuses(conn: Conn) -> dict[str, int]:
    return {
        str(s): int(n)
        for s, n in conn.execute("SELECT status::text, count(*) FROM pgqueue_jobs GROUP BY 1")
    }


def holders(conn: Conn) -> list[int]:
    """Pids of the workers holding 'limited' jobs right now."""
    return [
        int(pid)
        for (pid,) in conn.execute(
            "SELECT w.pid FROM pgqueue_jobs j JOIN pgqueue_workers w ON w.id = j.worker_id"
            " WHERE j.status = 'running' AND j.task = 'limited'"
        )
    ]


def test_a_limit_holds_across_processes_and_a_killed_workers_slot_returns_after_its_lease(
    app: pgqueue.App, conn: Conn, workers: WorkerProcesses
) -> None:
    procs = [workers.start("--concurrency", "4", "--lease", "2") for _ in range(3)]
    registered(conn, 3)
    app.enqueue_many([("limited", {"seconds": 0.3}) for _ in range(16)], allow_unknown=True)
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE limit_key = ''").fetchone() == (
        16,
    )  # enqueued by name: the database gave them the task's group
    wait_until(lambda: holders(conn), timeout=30)
    victim = holders(conn)[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = conn.execute("SELECT now()").fetchone()
    wait_until(lambda: statuses(conn) == {"succeeded": 16}, timeout=90)
    assert most_leases_at_once(conn) == {"limited/": 2}
    # The killed worker's slot came back by the reaper, after its lease (2 s) ran out.
    reaped = conn.execute(
        "SELECT min(at) FROM history_transitions WHERE new_error LIKE 'LeaseExpired%%'"
    ).fetchone()
    assert reaped is not None and killed_at is not None and reaped[0] is not None
    assert (reaped[0] - killed_at[0]).total_seconds() > 1.0
    assert [p for p in procs if p.pid != victim and p.poll() is not None] == []


def test_a_stalled_workers_slot_is_freed_once_by_the_reaper_and_its_late_ack_frees_nothing(
    app: pgqueue.App, dsn: str, conn: Conn, workers: WorkerProcesses
) -> None:
    zombie = workers.start("--concurrency", "2", "--lease", "2")
    registered(conn, 1)
    app.enqueue_many(
        [("limited", {"seconds": 0.1, "first_attempt_seconds": 4.0}) for _ in range(2)]
        + [("limited", {"seconds": 0.1}) for _ in range(6)],
        allow_unknown=True,
    )
    wait_until(lambda: holders(conn) == [zombie.pid] * 2, timeout=30)
    os.kill(zombie.pid, signal.SIGSTOP)
    rescuer = workers.start("--concurrency", "4", "--lease", "2")
    try:
        # Both slots stay taken until the stalled worker's leases are reaped; then the rescuer
        # runs everything, the two reaped jobs again included.
        wait_until(lambda: statuses(conn) == {"succeeded": 8}, timeout=60)
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    wait_until(
        lambda: (
            conn.execute(
                "SELECT stale_writes >= 1 FROM pgqueue_workers WHERE pid = %s", (zombie.pid,)
            ).fetchone()
            == (True,)
        ),
        timeout=30,
    )
    assert most_leases_at_once(conn) == {"limited/": 2}
    # Nothing is left running under a dead lease, and the zombie's late results changed nothing.
    assert statuses(conn) == {"succeeded": 8}
    assert rescuer.poll() is None and zombie.poll() is None


def test_one_job_per_key_across_processes(dsn: str, conn: Conn, workers: WorkerProcesses) -> None:
    for _ in range(2):
        workers.start("--concurrency", "6", "--lease", "5")
    registered(conn, 2)
    producer = pgqueue.App(dsn)

    @producer.task(name="per_tenant", limit=1, limit_key=lambda args: args["tenant"])
    async def per_tenant(tenant: str, seconds: float = 0.0) -> None: ...

    try:
        producer.enqueue_many(
            [("per_tenant", {"tenant": t, "seconds": 0.1}) for _ in range(5) for t in "abcd"]
        )
        wait_until(lambda: statuses(conn) == {"succeeded": 20}, timeout=60)
    finally:
        producer.close()
    peaks = most_leases_at_once(conn)
    assert peaks == {f"per_tenant/{t}": 1 for t in "abcd"}
    # The tenants ran side by side: over the whole run more than one key was running at once.
    rows = conn.execute(
        "SELECT CASE WHEN new_status = 'running' THEN 1 ELSE -1 END FROM history_transitions"
        " WHERE (new_status = 'running') <> (old_status = 'running') ORDER BY at, seq"
    ).fetchall()
    running, most = 0, 0
    for (step,) in rows:
        running += step
        most = max(most, running)
    assert most > 1
