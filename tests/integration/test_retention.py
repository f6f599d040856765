"""Retention at scale: finished jobs leave pgqueue_jobs per status (retention, dead_retention), in
bounded batches that never hold up a claim or an ack, with their attempts and dependency links,
never while a unique key or a waiting child still needs them; or move to the partitioned
archive (archive=True), where App.get_job, App.wait, `pgqueue job` and the job page find them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg_pool import AsyncConnectionPool
from starlette.testclient import TestClient

import pgqueue
from pgqueue.backoff import Backoff
from pgqueue.cli import main
from pgqueue.dashboard.app import create_app
from pgqueue.errors import ConfigurationError
from pgqueue.migrate import available, migrate
from pgqueue.worker import reaper as reaper_module
from pgqueue.worker.reaper import Reaper
from pgqueue.worker.state import WorkerState
from tests.helpers import register_worker

Conn = psycopg.Connection[tuple[Any, ...]]
DAY = 86400.0


def finished(conn: Conn, status: str, age: float, n: int = 1) -> list[int]:
    """n jobs that reached ``status`` ``age`` seconds ago (rows written directly: the prune only
    looks at status and finished_at)."""
    rows = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at, result)"
        " SELECT 'q', 't', %(status)s::pgqueue_status, 1,"
        " now() - make_interval(secs => %(age)s), '{\"n\": 1}'::jsonb"
        " FROM generate_series(1, %(n)s) RETURNING id",
        {"status": status, "age": age, "n": n},
    ).fetchall()
    return [int(r[0]) for r in rows]


def remaining(conn: Conn, ids: list[int]) -> list[int]:
    rows = conn.execute("SELECT id FROM pgqueue_jobs WHERE id = ANY(%s) ORDER BY id", [ids])
    return [int(r[0]) for r in rows.fetchall()]


def prune(app: pgqueue.App, **options: Any) -> int:
    """One prune round of a reaper with these options, as a worker's would run it."""

    async def run() -> int:
        async with AsyncConnectionPool(
            app.dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        ) as pool:
            reaper = Reaper(
                pool,
                app.q,
                WorkerState(concurrency=1, prefetch=0),
                backoff=Backoff(),
                interval=1.0,
                lease=30.0,
                **{"retention": DAY, **options},
            )
            return await reaper.prune()

    return asyncio.run(run())


def test_dead_jobs_are_pruned_only_with_a_dead_retention(app: pgqueue.App, conn: Conn) -> None:
    old_done = finished(conn, "succeeded", 2 * DAY) + finished(conn, "cancelled", 2 * DAY)
    recent = finished(conn, "succeeded", 60)
    dead = finished(conn, "dead", 2 * DAY)
    recent_dead = finished(conn, "dead", 60)
    assert prune(app, retention=3600) == 2
    assert remaining(conn, old_done + recent + dead + recent_dead) == recent + dead + recent_dead
    assert prune(app, retention=3600, dead_retention=3600) == 1
    assert remaining(conn, recent + dead + recent_dead) == recent + recent_dead


def test_a_prune_statement_takes_at_most_one_batch_and_a_round_stops_at_its_budget(
    app: pgqueue.App, conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = finished(conn, "succeeded", 2 * DAY, n=25)
    monkeypatch.setattr(reaper_module, "PRUNE_BUDGET", 0.0)  # one statement per round
    assert prune(app, batch=10) == 10
    assert len(remaining(conn, ids)) == 15
    monkeypatch.setattr(reaper_module, "PRUNE_BUDGET", 60.0)
    assert prune(app, batch=10) == 15  # batches of 10, 10 and 5
    assert remaining(conn, ids) == []


def test_retention_rejects_bad_values_in_one_sentence(app: pgqueue.App) -> None:
    with pytest.raises(ConfigurationError, match="dead_retention must be at least 0"):
        app.worker(dead_retention=-1)
    with pytest.raises(ConfigurationError, match="archive_retention applies only with archive"):
        app.worker(archive_retention=DAY)
    with pytest.raises(ConfigurationError, match="must be longer than retention"):
        app.worker(archive=True, retention=DAY, archive_retention=3600)
    with pytest.raises(ConfigurationError, match="set one of them"):
        app.worker(archive=True, retention=None)


def test_a_succeeded_unique_job_keeps_its_key_past_the_retention(
    app: pgqueue.App, conn: Conn
) -> None:
    first = app.enqueue("t", {}, allow_unknown=True, unique_key="report", unique_for=7200)
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now() - interval '1 hour'"
        " WHERE id = %s",
        [first],
    )
    assert prune(app, retention=60) == 0
    assert remaining(conn, [first]) == [first]
    again = app.enqueue("t", {}, allow_unknown=True, unique_key="report", unique_for=7200)
    assert again.duplicate and again == first
    conn.execute(
        "UPDATE pgqueue_jobs SET finished_at = now() - interval '3 hours' WHERE id = %s", [first]
    )
    assert prune(app, retention=60) == 1


def _finish(app: pgqueue.App, conn: Conn, job_id: int, age: float) -> None:
    """Claims and acks ``job_id`` as succeeded (its children are released by the ack's trigger),
    then dates it back."""
    worker = uuid.uuid4()
    register_worker(conn, worker, 30)
    token = uuid.uuid4()
    conn.execute("UPDATE pgqueue_jobs SET priority = 100 WHERE id = %s", [job_id])
    claimed = conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 1, "token": token, "tasks": None}
    ).fetchall()
    assert [int(r[0]) for r in claimed] == [job_id]
    conn.execute(
        app.q.complete_jobs,
        {
            "lock_timeout": "1s", "ids": [job_id], "tokens": [token], "statuses": ["succeeded"],
            "delays": [0.0], "errors": [None], "results": ['{"parent": 1}'], "run_seconds": [0.1],
        },
    ).fetchall()  # fmt: skip
    conn.execute(
        "UPDATE pgqueue_jobs SET finished_at = now() - make_interval(secs => %s) WHERE id = %s",
        [age, job_id],
    )


def test_a_parent_stays_until_its_children_finish_and_its_links_go_with_it(
    app: pgqueue.App, conn: Conn
) -> None:
    parent = app.enqueue("t", {}, allow_unknown=True)
    child = app.enqueue("t", {}, allow_unknown=True, after=[parent])
    _finish(app, conn, parent, 2 * DAY)
    assert conn.execute("SELECT status::text FROM pgqueue_jobs WHERE id = %s", [child]).fetchone()
    assert prune(app) == 0  # the child, queued now, reads its parent's result when it runs
    assert remaining(conn, [parent]) == [parent]
    _finish(app, conn, child, 2 * DAY)
    assert prune(app) == 2
    assert conn.execute("SELECT count(*) FROM pgqueue_job_deps").fetchone() == (0,)


@pytest.mark.parametrize("statement", ["prune_finished_jobs", "archive_finished_jobs"])
def test_a_claim_and_an_ack_complete_while_a_batch_holds_its_locks(
    app: pgqueue.App, conn: Conn, dsn: str, statement: str
) -> None:
    finished(conn, "succeeded", 2 * DAY, n=50)
    if statement == "archive_finished_jobs":
        conn.execute(app.q.archive_partitions, {"keep_seconds": None, "with_dead": False})
    running = app.enqueue("t", {}, allow_unknown=True)
    worker = uuid.uuid4()
    register_worker(conn, worker, 30)
    token = uuid.uuid4()
    claim = {"worker_id": worker, "limit": 1, "token": token, "tasks": None}
    assert [r[0] for r in conn.execute(app.q.claim_jobs, claim).fetchall()] == [running]
    waiting = app.enqueue("t", {}, allow_unknown=True)
    with psycopg.connect(dsn) as pruner:  # a batch whose transaction stays open
        cur = pruner.execute(
            getattr(app.q, statement), {"older_than": DAY, "batch": 100, "keep_seconds": None}
        )
        assert cur.rowcount == 50
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SET lock_timeout = '10s'")  # a wait would fail it, not hang
            other.execute("SET statement_timeout = '20s'")
            second = {**claim, "token": uuid.uuid4()}
            assert [r[0] for r in other.execute(app.q.claim_jobs, second).fetchall()] == [waiting]
            acked = other.execute(
                app.q.complete_jobs,
                {
                    "lock_timeout": "10s", "ids": [running], "tokens": [token],
                    "statuses": ["succeeded"], "delays": [0.0], "errors": [None],
                    "results": [None], "run_seconds": [0.1],
                },
            ).fetchall()  # fmt: skip
            assert [r[0] for r in acked] == [running]
            assert app.enqueue("t", {}, allow_unknown=True) > waiting
        pruner.rollback()


def test_archived_jobs_move_with_their_attempts_and_are_still_found(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    job_id = app.enqueue("t", {"x": 1}, allow_unknown=True)
    conn.execute(
        "INSERT INTO pgqueue_attempts (job_id, attempt, outcome, error)"
        " VALUES (%s, 1, 'retrying', 'ValueError: once')",
        [job_id],
    )
    _finish(app, conn, job_id, 2 * DAY)
    dead = finished(conn, "dead", 2 * DAY)
    assert prune(app, archive=True, retention=3600) == 1  # dead jobs stay: no dead_retention
    assert remaining(conn, [job_id, *dead]) == dead
    row = conn.execute(
        "SELECT status, result, args, jsonb_array_length(attempt_history)"
        " FROM pgqueue_jobs_archive WHERE id = %s",
        [job_id],
    ).fetchone()
    assert row == ("succeeded", {"parent": 1}, {"x": 1}, 1)
    assert conn.execute("SELECT count(*) FROM pgqueue_attempts").fetchone() == (0,)
    job = app.get_job(job_id)
    assert job is not None and job.status == "succeeded" and job.result == {"parent": 1}
    assert app.wait(job_id, timeout=10) == {"parent": 1}
    shown = CliRunner().invoke(main, ["job", str(job_id), "--dsn", dsn])
    assert shown.exit_code == 0, shown.output
    assert "succeeded" in shown.output
    with TestClient(create_app(dsn, refresh_interval=5), base_url="http://127.0.0.1") as client:
        page = client.get(f"/jobs/{job_id}")
        assert page.status_code == 200 and "ValueError: once" in page.text
        api = client.get(f"/api/jobs/{job_id}").json()
        assert api["status"] == "succeeded" and api["archived"] is True
        assert [a["outcome"] for a in api["attempt_history"]] == ["retrying", "succeeded"]
    assert prune(app, archive=True, retention=3600, dead_retention=3600) == 1
    assert remaining(conn, dead) == []
    archived = app.get_job(dead[0])
    assert archived is not None and archived.status == "dead"


def test_upgrading_to_18_lets_a_role_that_reads_jobs_read_the_archive(empty_dsn: str) -> None:
    role = f"pgqueue_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, migrations=[m for m in available() if m.version < 18])
        try:
            conn.execute(f"CREATE ROLE {role}")
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("this test server does not let the test user create roles")
        try:
            conn.execute(f"GRANT SELECT ON pgqueue_jobs TO {role}")
            assert 18 in migrate(conn)
            granted = conn.execute(
                "SELECT has_table_privilege(%s, 'pgqueue_jobs_archive', 'SELECT')", (role,)
            ).fetchone()
            assert granted == (True,)
        finally:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def _partitions(conn: Conn) -> list[str]:
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'pgqueue_jobs_archive'::regclass ORDER BY 1"
    ).fetchall()
    return [str(r[0]) for r in rows]


def _day(conn: Conn, days_ago: int) -> str:
    row = conn.execute(
        "SELECT to_char((now() AT TIME ZONE 'UTC')::date - %s, 'YYYYMMDD')", [days_ago]
    ).fetchone()
    assert row is not None
    return f"pgqueue_jobs_archive_{row[0]}"


def test_archive_partitions_are_made_ahead_and_dropped_whole_by_age(
    app: pgqueue.App, conn: Conn
) -> None:
    old = finished(conn, "succeeded", 5 * DAY)
    older = finished(conn, "succeeded", 20 * DAY)
    kept_dead = finished(conn, "dead", 40 * DAY)  # no dead_retention: it never moves
    assert prune(app, archive=True, retention=3600) == 2
    made = _partitions(conn)
    assert _day(conn, 20) in made and _day(conn, 5) in made and _day(conn, -2) in made
    assert _day(conn, 21) not in made and _day(conn, -3) not in made
    assert remaining(conn, kept_dead) == kept_dead
    assert remaining(conn, old + older) == []
    # A 10-day archive: days wholly before it are dropped with their jobs.
    assert prune(app, archive=True, retention=3600, archive_retention=10 * DAY) == 0
    kept = _partitions(conn)
    assert _day(conn, 20) not in kept and _day(conn, 5) in kept and _day(conn, -2) in kept
    assert conn.execute("SELECT array_agg(id) FROM pgqueue_jobs_archive").fetchone() == (old,)
    # Jobs already past the archive's retention are deleted, not moved into a dropped day.
    gone = finished(conn, "succeeded", 30 * DAY)
    assert prune(app, archive=True, retention=3600, archive_retention=10 * DAY) == 1
    assert remaining(conn, gone) == [] and _day(conn, 30) not in _partitions(conn)


def test_the_cli_takes_retention_flags_and_their_variables(
    app: pgqueue.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(pgqueue.App, "run_worker", lambda self, **options: seen.update(options))
    monkeypatch.setenv("PGQUEUE_WORKER_DEAD_RETENTION", "7d")
    result = CliRunner().invoke(
        main,
        ["worker", "--app", "tests.acceptance.jobs_app:app", "--dsn", app.dsn,
         "--retention", "10m", "--archive", "--archive-retention", "30d"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (seen["retention"], seen["dead_retention"]) == (600.0, 7 * DAY)
    assert (seen["archive"], seen["archive_retention"]) == (True, 30 * DAY)
    bad = CliRunner().invoke(
        main, ["worker", "--app", "tests.acceptance.jobs_app:app", "--dsn", app.dsn,
               "--retention", "soon"],
    )  # fmt: skip
    assert bad.exit_code != 0 and "--retention 'soon'" in bad.output


def test_rate_logs_that_count_for_nothing_are_pruned(app: pgqueue.App, conn: Conn) -> None:
    """A per-key rate writes a row per key into pgqueue_rates; a key that goes quiet kept its row
    for ever (a table growing with every user ever rate-limited). The prune drops a row once its
    newest entry has left its period, judged by the longer of the row's and the one its task or
    queue has now (a period raised since the row was written must still see it), and never one
    that still counts."""
    conn.execute(
        "INSERT INTO pgqueue_tasks (name, rate_limit, rate_period) VALUES ('fast', 5, 60),"
        " ('slow', 1, 600), ('slow:k', 1, 60)"
    )
    conn.execute(
        "INSERT INTO pgqueue_queues (name, rate_limit, rate_period) VALUES ('api', 1, 600)"
    )
    logs = {
        "t:4:fast:quiet": (60, 120),  # period 60 s, newest entry 2 min old: counts for nothing
        "t:4:fast:busy": (60, 10),  # 10 s old: still in its window
        "t:4:slow:k": (60, 300),  # written with 60 s, but its task's rate is 10 min now
        "t:6:slow:k:x": (60, 300),  # task 'slow:k' (60 s), not 'slow': goes
        "q:api": (60, 300),  # the queue's rate is 10 min now
        "q:old": (60, 900),  # a queue without a rate now: goes
    }
    for name, (period, age) in logs.items():
        conn.execute(
            "INSERT INTO pgqueue_rates (name, period, times, counts) VALUES (%s, %s,"
            " ARRAY[now() - make_interval(secs => %s + 5), now() - make_interval(secs => %s)],"
            " ARRAY[1, 1])",
            (name, period, age, age),
        )
    prune(app)
    kept = {r[0] for r in conn.execute("SELECT name FROM pgqueue_rates").fetchall()}
    assert kept == {"t:4:fast:busy", "t:4:slow:k", "q:api"}
