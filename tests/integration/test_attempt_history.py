"""The history of attempts (pgqueue_attempts, migration 0016): written with the fenced write that
ended an attempt that did not succeed, never by a refused ack or a success, deleted with its
job, and listed on the job page and in /api/jobs/{id}."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

import pgqueue
from pgqueue import operations
from pgqueue.cli import main
from pgqueue.dashboard.app import create_app
from pgqueue.migrate import available, migrate
from tests.dashboard_data import XSS
from tests.helpers import register_worker, running_worker, wait_until_async
from tests.plans import explain, nodes

Conn = psycopg.Connection[tuple[Any, ...]]
FAST = {"lease": 2.0, "heartbeat_interval": 0.5, "poll_interval": 0.2, "reaper_interval": 0.3}
BACKOFF = {"backoff_base": 1.0, "backoff_cap": 3600.0, "pause": 0.0}


@pytest.fixture
def client(dsn: str) -> Iterator[TestClient]:
    with TestClient(create_app(dsn, refresh_interval=5), base_url="http://127.0.0.1") as c:
        yield c


def claim(app: pgqueue.App, conn: Conn, worker: uuid.UUID) -> uuid.UUID:
    """Claims what is due, as the fetcher does; returns the claim's token."""
    register_worker(conn, worker, 30)
    token = uuid.uuid4()
    conn.execute(
        app.q.claim_jobs, {"worker_id": worker, "limit": 10, "token": token, "tasks": None}
    ).fetchall()
    return token


def ack(
    app: pgqueue.App, conn: Conn, job_id: int, token: uuid.UUID, status: str, error: str | None
) -> list[int]:
    rows = conn.execute(
        app.q.complete_jobs,
        {
            "lock_timeout": "100ms", "ids": [job_id], "tokens": [token], "statuses": [status],
            "delays": [0.0], "errors": [error], "results": [None], "run_seconds": [0.1],
        },
    ).fetchall()  # fmt: skip
    return [int(r[0]) for r in rows]


def history(conn: Conn, job_id: int) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT attempt, worker_id, outcome, error, claimed_at IS NOT NULL,"
        " finished_at IS NOT NULL FROM pgqueue_attempts WHERE job_id = %s"
        " ORDER BY finished_at, attempt",
        (job_id,),
    ).fetchall()


def due_now(conn: Conn, job_id: int) -> None:
    conn.execute("UPDATE pgqueue_jobs SET run_at = now() WHERE id = %s", (job_id,))


async def test_a_job_failing_twice_then_succeeding_lists_three_attempts(
    app: pgqueue.App, conn: Conn, client: TestClient
) -> None:
    app.backoff = pgqueue.Backoff(base=0.05, cap=0.1)
    calls: list[int] = []

    @app.task(max_attempts=5)
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ValueError(f"boom {len(calls)}")
        return "ok"

    job_id = flaky.enqueue()
    async with running_worker(app, **FAST) as worker:
        await wait_until_async(
            lambda: (
                conn.execute(
                    "SELECT status::text FROM pgqueue_jobs WHERE id = %s", (job_id,)
                ).fetchone()
                == ("succeeded",)
            ),
            timeout=20,
        )
        worker_id = worker.id
    rows = history(conn, job_id)
    assert [(a, w, o, e.splitlines()[-1], c, f) for a, w, o, e, c, f in rows] == [
        (1, worker_id, "retrying", "ValueError: boom 1", True, True),
        (2, worker_id, "retrying", "ValueError: boom 2", True, True),
    ]
    body = client.get(f"/api/jobs/{job_id}").json()
    attempts = body["attempt_history"]
    assert body["attempts"] == 3
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [
        (1, "retrying"), (2, "retrying"), (3, "succeeded")
    ]  # fmt: skip
    assert [a["worker"] for a in attempts[:2]] == [str(worker_id)] * 2
    assert "ValueError: boom 1" in attempts[0]["error"] and attempts[2]["error"] is None
    assert attempts[2]["finished_at"] is not None and attempts[2]["worker"] is None
    page = client.get(f"/jobs/{job_id}").text
    assert page.count('class="attempt"') == 3
    assert str(worker_id)[:8] in page and "boom 2" in page
    # The same history from Python and from the command line.
    listed = app.job_attempts(job_id)
    assert [(a.number, a.outcome, a.worker_id) for a in listed] == [
        (1, "retrying", worker_id), (2, "retrying", worker_id), (3, "succeeded", None)
    ]  # fmt: skip
    assert listed[1].error is not None and "ValueError: boom 2" in listed[1].error
    assert all(a.started_at and a.finished_at for a in listed)
    assert [a.number for a in app.job_attempts(job_id, limit=1)] == [2, 3]
    shown = CliRunner().invoke(main, ["job", str(job_id), "--dsn", app.dsn])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.split("attempt history:\n")[1].splitlines()
    assert lines[0].startswith("  #1 retrying") and f"worker {str(worker_id)[:8]}" in lines[0]
    assert "ValueError: boom 1" in shown.output.split("#2 retrying")[0].split("#1 retrying")[1]
    assert any(line.startswith("  #3 succeeded") and " ran " in line for line in lines)
    as_json = json.loads(
        CliRunner().invoke(main, ["job", str(job_id), "--json", "--dsn", app.dsn]).output
    )
    assert [a["outcome"] for a in as_json["attempt_history"]] == [
        "retrying",
        "retrying",
        "succeeded",
    ]


def test_job_attempts_of_a_job_that_never_ran_or_does_not_exist(app: pgqueue.App) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    assert app.job_attempts(job_id) == []
    assert app.job_attempts(987654321) == []
    with pytest.raises(pgqueue.InvalidJobError, match="positive integer"):
        app.job_attempts(0)
    with pytest.raises(pgqueue.ConfigurationError, match="limit must be"):
        app.job_attempts(job_id, limit=0)
    shown = CliRunner().invoke(main, ["job", str(job_id), "--dsn", app.dsn])
    assert shown.exit_code == 0 and "attempt history" not in shown.output


def test_a_reaped_lease_records_lease_expired_with_its_worker(app: pgqueue.App, conn: Conn) -> None:
    job_id = app.enqueue("t", {}, max_attempts=2, allow_unknown=True)
    worker = uuid.uuid4()
    claim(app, conn, worker)
    conn.execute(
        "UPDATE pgqueue_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (job_id,),
    )
    reaped = conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall()
    assert reaped == [(job_id, "retrying", 1, "default")]  # the reaper's answer is unchanged
    ((attempt, worker_id, outcome, error, claimed, finished),) = history(conn, job_id)
    assert (attempt, worker_id, outcome, claimed, finished) == (
        1, worker, "lease expired", True, True
    )  # fmt: skip
    assert error.startswith(f"LeaseExpired: worker {worker}")


def test_a_refused_stale_ack_writes_no_history(app: pgqueue.App, conn: Conn) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    worker_a, worker_b = uuid.uuid4(), uuid.uuid4()
    token_a = claim(app, conn, worker_a)
    conn.execute(
        "UPDATE pgqueue_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (job_id,),
    )
    conn.execute(app.q.reap_expired_leases, BACKOFF).fetchall()
    due_now(conn, job_id)
    token_b = claim(app, conn, worker_b)
    before = history(conn, job_id)
    assert [r[2] for r in before] == ["lease expired"]

    assert ack(app, conn, job_id, token_a, "dead", "ValueError: too late") == []  # fenced off
    assert history(conn, job_id) == before
    # The holder's failure is recorded, its success would not be.
    assert ack(app, conn, job_id, token_b, "retrying", "ValueError: second") == [job_id]
    assert [(r[0], r[1], r[2]) for r in history(conn, job_id)] == [
        (1, worker_a, "lease expired"), (2, worker_b, "retrying")
    ]  # fmt: skip
    due_now(conn, job_id)
    token_c = claim(app, conn, worker_a)
    assert ack(app, conn, job_id, token_c, "succeeded", None) == [job_id]
    assert len(history(conn, job_id)) == 2


def test_cancelled_and_dead_attempts_are_recorded_and_errors_bounded(
    app: pgqueue.App, conn: Conn
) -> None:
    dead = app.enqueue("t", {}, allow_unknown=True)
    cancelled = app.enqueue("t", {}, allow_unknown=True)
    worker = uuid.uuid4()
    token = claim(app, conn, worker)
    conn.execute("UPDATE pgqueue_jobs SET cancel_requested_at = now() WHERE id = %s", (cancelled,))
    assert ack(app, conn, dead, token, "dead", "Fail: " + "x" * 20_000) == [dead]
    assert ack(app, conn, cancelled, token, "retrying", "CancelledError") == [cancelled]
    ((_, _, outcome, error, _, _),) = history(conn, dead)
    assert outcome == "dead" and len(error) == 8000
    assert [r[2] for r in history(conn, cancelled)] == ["cancelled"]


def test_retention_pruning_and_purge_delete_the_history_with_the_jobs(
    app: pgqueue.App, conn: Conn
) -> None:
    pruned, purged, kept = (app.enqueue("t", {}, allow_unknown=True) for _ in range(3))
    worker = uuid.uuid4()
    token = claim(app, conn, worker)
    for job_id in (pruned, purged, kept):
        assert ack(app, conn, job_id, token, "retrying", "ValueError: once") == [job_id]
        due_now(conn, job_id)
    token = claim(app, conn, worker)
    for job_id in (pruned, purged, kept):
        assert ack(app, conn, job_id, token, "succeeded", None) == [job_id]
    conn.execute(
        "UPDATE pgqueue_jobs SET finished_at = now() - interval '2 days' WHERE id = %s", (pruned,)
    )
    cur = conn.execute(app.q.prune_finished_jobs, {"older_than": 86400.0, "batch": 100})
    assert cur.rowcount == 1  # the reaper counts pruned jobs by rowcount
    assert history(conn, pruned) == []
    with app.connection() as c:
        f = operations.JobFilter.of(status=["succeeded"], older_than="0s")
        assert operations.bulk(c, app.q, "purge", f) == 2
    assert history(conn, purged) == [] and history(conn, kept) == []
    assert conn.execute("SELECT count(*) FROM pgqueue_attempts").fetchone() == (0,)


def test_the_page_lists_attempts_and_escapes_their_errors(
    app: pgqueue.App, conn: Conn, client: TestClient
) -> None:
    job_id = app.enqueue("t", {}, allow_unknown=True)
    worker = uuid.uuid4()
    token = claim(app, conn, worker)
    assert ack(app, conn, job_id, token, "retrying", f"ValueError: {XSS}\nline two") == [job_id]
    due_now(conn, job_id)
    claim(app, conn, worker)  # running: the row's own attempt is listed last
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    assert XSS not in page.text and "&lt;" in page.text
    assert page.text.count('class="attempt"') == 2
    assert "<details>" in page.text and "line two" in page.text
    attempts = client.get(f"/api/jobs/{job_id}").json()["attempt_history"]
    assert [(a["attempt"], a["outcome"], a["worker"]) for a in attempts] == [
        (1, "retrying", str(worker)), (2, "running", str(worker))
    ]  # fmt: skip
    assert attempts[0]["error"] == f"ValueError: {XSS}\nline two"


def test_upgrading_to_16_lets_a_role_that_reads_jobs_read_their_attempts(empty_dsn: str) -> None:
    role = f"pgqueue_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, migrations=[m for m in available() if m.version <= 15])
        try:
            conn.execute(f"CREATE ROLE {role}")
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("this test server does not let the test user create roles")
        try:
            conn.execute(f"GRANT SELECT ON pgqueue_jobs TO {role}")
            assert migrate(conn, migrations=[m for m in available() if m.version <= 16]) == [16]
            granted = conn.execute(
                "SELECT has_table_privilege(%s, 'pgqueue_attempts', 'SELECT')", (role,)
            ).fetchone()
            assert granted == (True,)
        finally:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("generic", [True, False], ids=["generic", "custom"])
def test_a_batch_of_successes_reads_and_writes_no_history(
    app: pgqueue.App, conn: Conn, generic: bool
) -> None:
    """The history costs a successful ack nothing: the worker's lookup and the insert run for
    failed rows only, and a failure's lookup is one primary-key probe."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at)"
        " SELECT 'default', 't', 'succeeded', 1, now() FROM generate_series(1, 20000)"
    )
    ids = [app.enqueue("t", {}, allow_unknown=True) for _ in range(10)]  # one claim's worth
    token = claim(app, conn, uuid.uuid4())
    conn.execute("ANALYZE pgqueue_jobs")
    for status, probes in (("succeeded", 0), ("retrying", len(ids))):
        values = {
            "lock_timeout": "100ms", "ids": ids, "tokens": [token] * len(ids),
            "statuses": [status] * len(ids), "delays": [0.0] * len(ids),
            "errors": ["E"] * len(ids), "results": [None] * len(ids),
            "run_seconds": [0.1] * len(ids),
        }  # fmt: skip
        plan = explain(conn, app.q.complete_jobs, values, generic=generic)
        (insert,) = [n for n in nodes(plan) if n.get("Relation Name") == "pgqueue_attempts"]
        assert insert["Actual Rows"] == 0  # an INSERT returns nothing; its input:
        lookups = [
            n
            for n in nodes(insert)
            if n.get("Relation Name") == "pgqueue_jobs" and n["Actual Loops"] > 0
        ]
        assert sum(int(n["Actual Loops"]) for n in lookups) == probes, (status, lookups)
        assert all(n["Index Name"] == "pgqueue_jobs_pkey" for n in lookups)
