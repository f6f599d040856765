"""Real worker processes firing a per-second schedule: exactly one job per tick, none missed,
through SIGKILL, clock skew, an outage and another app's worker."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from tests.helpers import WorkerProcesses, wait_until

pytestmark = pytest.mark.acceptance

APP = "tests.acceptance.schedule_app:app"
SECOND = timedelta(seconds=1)
T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    result: T = wait_until(predicate, timeout, interval=0.1, what=what)
    return result


class Workers(WorkerProcesses):
    def start(  # type: ignore[override]
        self, *, offset: float = 0, missed: str = "all"
    ) -> subprocess.Popen[bytes]:
        env = {"PGQUEUE_TEST_CLOCK_OFFSET": str(offset), "PGQUEUE_TEST_MISSED": missed}
        return super().start("--concurrency", "2", "--grace-period", "2", env=env)


@pytest.fixture
def workers(dsn: str, tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(dsn, APP, tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all(15)


def ticks(conn: Conn) -> list[datetime]:
    rows = conn.execute(
        "SELECT schedule_tick, count(*) FROM pgqueue_jobs WHERE schedule_name = 'every-second' "
        "GROUP BY schedule_tick ORDER BY schedule_tick"
    ).fetchall()
    assert all(count == 1 for _, count in rows), "a tick got more than one job"
    return [tick for tick, _ in rows]


def assert_contiguous(found: list[datetime]) -> None:
    gaps = [(a, b) for a, b in pairwise(found) if b - a != SECOND]
    assert not gaps, f"missed ticks between {gaps}"


def test_three_workers_fire_one_job_per_tick_even_when_one_is_killed(
    workers: Workers, conn: Conn
) -> None:
    procs = [workers.start() for _ in range(3)]
    wait_for(lambda: len(ticks(conn)) >= 10, 30, "10 ticks from three workers")
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait(5)
    before = len(ticks(conn))
    wait_for(lambda: len(ticks(conn)) >= before + 12, 30, "12 more ticks after SIGKILL")
    found = ticks(conn)
    assert len(found) >= 22
    assert_contiguous(found)
    # Every tick was fired as an ordinary job that the workers then ran.
    wait_for(
        lambda: (
            conn.execute(
                "SELECT count(*) = 0 FROM pgqueue_jobs WHERE status <> 'succeeded' "
                "AND schedule_tick < now() - interval '5 seconds'"
            ).fetchone()
            == (True,)
        ),
        20,
        "the scheduled jobs to succeed",
    )


def test_a_worker_of_another_app_without_schedules_does_not_stop_them(
    workers: Workers, conn: Conn, dsn: str, tmp_path: Path
) -> None:
    """Another service on the same database (its app declares no schedules, and has the same
    default name) starts a worker: the schedule keeps firing every tick."""
    workers.start()
    wait_for(lambda: len(ticks(conn)) >= 3, 30, "3 ticks")
    other = WorkerProcesses(dsn, "tests.acceptance.jobs_app:app", tmp_path / "other")
    (tmp_path / "other").mkdir()
    try:
        other.start("--queues", "elsewhere", "--log-level", "INFO")
        # Its sync names the schedule, which its code does not declare (and leaves it alone).
        wait_for(lambda: "every-second" in other.output(), 30, "the other's sync")
        before = len(ticks(conn))
        wait_for(lambda: len(ticks(conn)) >= before + 5, 30, "5 more ticks")
    finally:
        other.stop_all(15)
    assert_contiguous(ticks(conn))


def test_skewed_clocks_and_an_outage_keep_one_job_per_tick_and_the_missed_policy(
    workers: Workers, conn: Conn
) -> None:
    workers.start(offset=600)  # ten minutes fast
    workers.start(offset=-600)  # ten minutes slow
    wait_for(lambda: len(ticks(conn)) >= 10, 30, "10 ticks from skewed workers")
    workers.stop_all()
    found = ticks(conn)
    assert_contiguous(found)
    last_before = found[-1]

    # Outage: no worker while several ticks pass; then the "latest" policy on restart.
    last_before = outage_then_restart(workers, conn, last_before, gap=4, missed="latest")
    first_batch = fired_together(conn, last_before)
    assert len(first_batch) == 1  # one job for the newest missed tick, none for older ones
    assert first_batch[0] - last_before >= 4 * SECOND

    # Then "all" with max_catchup=5 after an 8 s outage: the newest 5 missed ticks at once.
    found = ticks(conn)
    assert_contiguous([t for t in found if t >= first_batch[0]])
    last_before = outage_then_restart(workers, conn, found[-1], gap=8, missed="all")
    batch = fired_together(conn, last_before)
    assert len(batch) == 5
    assert_contiguous(batch)
    assert batch[0] - last_before >= 3 * SECOND  # the older missed ticks were skipped


def outage_then_restart(
    workers: Workers, conn: Conn, last_before: datetime, *, gap: int, missed: str
) -> datetime:
    """Stop every worker, wait (by the database clock) for ``gap`` seconds of ticks to pass,
    start one worker with the ``missed`` policy and wait for its first ticks."""
    workers.stop_all()
    last_before = max(last_before, ticks(conn)[-1])
    wait_for(
        lambda: (
            conn.execute(
                "SELECT now() > %s + make_interval(secs => %s)", (last_before, gap)
            ).fetchone()
            == (True,)
        ),
        gap + 10,
        f"a {gap} s outage",
    )
    count = len(ticks(conn))
    workers.start(missed=missed)
    wait_for(lambda: len(ticks(conn)) >= count + 1, 30, "ticks after the restart")
    return last_before


def fired_together(conn: Conn, after: datetime) -> list[datetime]:
    """The ticks of the first firing transaction after ``after`` (they share created_at)."""
    rows = conn.execute(
        "SELECT schedule_tick FROM pgqueue_jobs WHERE schedule_name = 'every-second' "
        "AND created_at = (SELECT min(created_at) FROM pgqueue_jobs "
        "                  WHERE schedule_name = 'every-second' AND schedule_tick > %s) "
        "ORDER BY schedule_tick",
        (after,),
    ).fetchall()
    return [tick for (tick,) in rows]
