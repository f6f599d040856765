"""Operators' bulk actions, search and audit, from Python and the CLI, on a real database."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

import pgqueue
from pgqueue import operations
from pgqueue.cli import main

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    return CliRunner()


def run(runner: CliRunner, *args: str) -> Result:
    return runner.invoke(main, list(args))


def plant(conn: Conn) -> None:
    """Jobs of two tasks in every status, some finished long ago."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at, last_error) "
        "SELECT q, t, s::pgqueue_status, 3, CASE WHEN s IN ('succeeded', 'dead', 'cancelled') "
        "THEN now() - (n || ' hours')::interval END, "
        "CASE WHEN s = 'dead' THEN E'ValueError: bad\\ntraceback' END "
        "FROM unnest(ARRAY['a', 'b']) q, unnest(ARRAY['send', 'sync']) t, "
        "unnest(ARRAY['queued', 'retrying', 'succeeded', 'dead', 'cancelled']) s, "
        "generate_series(1, 3) n"
    )


def count(conn: Conn, where: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM pgqueue_jobs WHERE {where}").fetchone()  # noqa: S608
    assert row is not None
    return int(row[0])


def test_requeue_by_filter_with_a_dry_run_and_an_audit_row(app: pgqueue.App, conn: Conn) -> None:
    plant(conn)
    assert app.requeue_jobs(task="send", since="150m", dry_run=True) == 4  # 2 queues x 1h, 2h
    assert count(conn, "status = 'dead'") == 12  # nothing changed
    assert app.requeue_jobs(task="send", since="150m") == 4
    assert count(conn, "status = 'dead' AND task = 'send'") == 2
    requeued = conn.execute(
        "SELECT DISTINCT attempts, finished_at FROM pgqueue_jobs WHERE task = 'send'"
        " AND status = 'queued' AND last_error IS NOT NULL"
    ).fetchall()
    assert requeued == [(0, None)]
    entries = app.audit_log()
    assert [(e.action, e.dry_run, e.matched, e.finished_at is not None) for e in entries] == [
        ("requeue", False, 4, True),
        ("requeue", True, 4, True),
    ]
    assert entries[0].filter == {"task": "send", "statuses": ["dead"], "since": 9000.0}
    assert "@" in entries[0].actor


def test_cancel_and_purge_by_filter_in_small_batches(app: pgqueue.App, conn: Conn) -> None:
    plant(conn)
    with app.connection() as c:
        changed = operations.bulk(c, app.q, "cancel", operations.JobFilter.of(queue="a"), batch=2)
    assert changed == 12  # queued and retrying of queue a, over six batches
    assert count(conn, "queue = 'a' AND status IN ('queued', 'retrying')") == 0
    assert count(conn, "queue = 'b' AND status IN ('queued', 'retrying')") == 12
    assert app.purge_jobs(older_than="90m") == 8  # succeeded 2h and 3h ago, 2 x 2
    assert count(conn, "status = 'succeeded'") == 4
    # Sync's dead and cancelled jobs of hours ago; those cancelled a moment ago are too young.
    assert app.purge_jobs(older_than="1m", status=["dead", "cancelled"], task="sync") == 12
    assert [e.matched for e in app.audit_log()] == [12, 8, 12]


def test_find_jobs_and_retry_now(app: pgqueue.App, conn: Conn) -> None:
    plant(conn)
    dead = app.find_jobs(task="sync", status="dead", limit=5)
    assert len(dead) == 5 and {j.status for j in dead} == {"dead"}
    assert dead[0].id > dead[-1].id and dead[0].error == "ValueError: bad"
    job = app.enqueue("later", {}, delay=3600, allow_unknown=True)
    assert app.retry_now(job)
    row = conn.execute("SELECT run_at <= now() FROM pgqueue_jobs WHERE id = %s", (job,))
    assert row.fetchone() == (True,)
    assert not app.retry_now(dead[0].id)  # not waiting
    with pytest.raises(pgqueue.JobNotFoundError):
        app.retry_now(10**9)


def test_bad_filters_are_refused_before_anything_changes(app: pgqueue.App, conn: Conn) -> None:
    plant(conn)
    with pytest.raises(pgqueue.InvalidJobError, match="requeue takes jobs that are dead"):
        app.requeue_jobs(status="queued")
    with pytest.raises(pgqueue.InvalidJobError, match="write it as 90s"):
        app.purge_jobs(older_than="a week")
    with pytest.raises(pgqueue.InvalidJobError, match="unknown status"):
        app.find_jobs(status="done")
    assert app.audit_log() == []


def test_the_cli_commands(runner: CliRunner, dsn: str, conn: Conn, app: pgqueue.App) -> None:
    plant(conn)
    dry = run(runner, "requeue", "--status", "dead", "--queue", "b", "--dry-run", "--dsn", dsn)
    assert dry.exit_code == 0 and dry.output == "6 jobs would be requeued\n"
    done = run(runner, "requeue", "--status", "dead", "--queue", "b", "--dsn", dsn)
    assert done.output == "6 jobs requeued\n"
    both = run(runner, "requeue", "5", "--task", "x", "--dsn", dsn)
    assert both.exit_code == 2 and "not both" in both.output
    neither = run(runner, "cancel", "--dsn", dsn)
    assert neither.exit_code == 2 and "give a job id" in neither.output
    assert run(runner, "cancel", "--task", "send", "--dsn", dsn).output == "15 jobs cancelled\n"
    purged = run(runner, "purge", "--older-than", "150m", "--dsn", dsn)
    assert purged.output == "4 jobs deleted\n"
    listed = run(runner, "jobs", "--status", "dead", "--limit", "3", "--dsn", dsn)
    assert listed.exit_code == 0 and len(listed.output.splitlines()) == 4
    assert "ValueError: bad" in listed.output
    as_json = run(runner, "jobs", "--task", "sync", "--limit", "2", "--json", "--dsn", dsn)
    assert [json.loads(line)["task"] for line in as_json.output.splitlines()] == ["sync", "sync"]
    log = run(runner, "audit", "--dsn", dsn)
    assert log.exit_code == 0 and [line.split()[2] for line in log.output.splitlines()] == [
        "purge", "cancel", "requeue", "requeue"
    ]  # fmt: skip
    job = app.enqueue("later", {}, delay=3600, allow_unknown=True)
    assert run(runner, "retry-now", str(job), "--dsn", dsn).output == f"job {job} is due now\n"
    bad = run(runner, "purge", "--older-than", "soon", "--dsn", dsn)
    assert bad.exit_code == 1 and "write it as 90s" in bad.output and "Traceback" not in bad.output
