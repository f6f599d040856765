"""The job detail page reads by index only, whatever the table holds and the statistics say.

Planned on a session configured like the dashboard's, generically (as a cached prepared
statement runs) and with the values, on a table with finished and waiting jobs, running jobs
under limits, and dependency rows skewed by one big group (its callback's 5,000 parents make
"child_id = <a job's id>" look like thousands of rows to the planner). The page's cost on a
table of 1,000,000 finished + 100,000 waiting jobs is measured by
benchmarks/dashboard_queries.py (docs/dashboard.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pgqueue.dashboard import job_page, queries
from pgqueue.dashboard.database import TRANSACTION_SETTINGS, session_options
from tests.plans import Conn, buffers, explain, nodes

#: The indexes through which the page may reach job and dependency rows: by id, or the few
#: running jobs.
INDEXES = {
    "pgqueue_jobs": {
        "pgqueue_jobs_pkey", "pgqueue_jobs_running_idx", "pgqueue_jobs_running_limited_idx"
    },
    "pgqueue_job_deps": {"pgqueue_job_deps_pkey", "pgqueue_job_deps_child_idx"},
    "pgqueue_attempts": {"pgqueue_attempts_job_idx"},
}  # fmt: skip
GROUP = 5_000


@pytest.fixture
def shaped(conn: Conn) -> dict[str, int]:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at)"
        " SELECT 'q' || g % 4, 'task_' || g % 20, 'succeeded', 1, now()"
        " FROM generate_series(1, 60000) g"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, limit_key)"
        " SELECT 'q' || g % 4, 'task_' || g % 20, CASE WHEN g % 20 = 1 THEN '' END"
        " FROM generate_series(1, 20000) g"
    )
    conn.execute("INSERT INTO pgqueue_workers (id, host, pid, concurrency, lease_expires_at)"
                 " VALUES (gen_random_uuid(), 'h', 1, 8, now() + interval '30 s')")  # fmt: skip
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', attempts = 1, lease_token = gen_random_uuid(),"
        " claimed_at = now(), worker_id = (SELECT id FROM pgqueue_workers)"
        " WHERE id IN (SELECT id FROM pgqueue_jobs WHERE status = 'queued' ORDER BY id LIMIT 8)"
    )
    conn.execute("INSERT INTO pgqueue_queues (name, concurrency_limit, rate_limit, rate_period)"
                 " VALUES ('q1', 10, 100, 60)")  # fmt: skip
    conn.execute("INSERT INTO pgqueue_tasks (name, concurrency_limit, rate_limit, rate_period)"
                 " VALUES ('task_1', 5, 50, 60)")  # fmt: skip
    conn.execute(
        "INSERT INTO pgqueue_rates (name, period, times, counts)"
        " VALUES ('q:q1', 60, ARRAY[now()], ARRAY[1]), ('t:6:task_1:', 60, ARRAY[now()], ARRAY[1])"
    )
    callback = _one(conn, "INSERT INTO pgqueue_jobs (queue, task, status)"
                          " VALUES ('q1', 'task_1', 'blocked') RETURNING id")  # fmt: skip
    conn.execute(
        "INSERT INTO pgqueue_job_deps (parent_id, child_id, position)"
        " SELECT id, %s, row_number() OVER (ORDER BY id) FROM pgqueue_jobs"
        " WHERE status = 'queued' ORDER BY id DESC LIMIT %s",
        (callback, GROUP),
    )
    conn.execute("INSERT INTO pgqueue_job_waits (child_id, waiting) VALUES (%s, %s)",
                 (callback, GROUP))  # fmt: skip
    conn.execute("UPDATE pgqueue_jobs SET has_children = true"
                 " WHERE id IN (SELECT parent_id FROM pgqueue_job_deps)")  # fmt: skip
    # Two failed attempts of every finished job, and many of one job that kept failing.
    conn.execute(
        "INSERT INTO pgqueue_attempts (job_id, attempt, worker_id, finished_at, outcome, error)"
        " SELECT id, a, gen_random_uuid(), now() - make_interval(secs => 3 - a), 'retrying',"
        " 'ValueError: ' || id FROM pgqueue_jobs, generate_series(1, 2) a"
        " WHERE status = 'succeeded'"
    )
    conn.execute(
        "INSERT INTO pgqueue_attempts (job_id, attempt, finished_at, outcome)"
        " SELECT (SELECT max(id) FROM pgqueue_jobs WHERE status = 'succeeded'), a,"
        " now() - make_interval(secs => 5000 - a), 'lease expired' FROM generate_series(3, 3000) a"
    )
    conn.execute("VACUUM ANALYZE")
    return {
        "callback": callback,
        "member": _one(conn, "SELECT max(parent_id) FROM pgqueue_job_deps"),
        "waiting": _one(conn, "SELECT min(id) FROM pgqueue_jobs WHERE status = 'queued'"),
        "running": _one(conn, "SELECT min(id) FROM pgqueue_jobs WHERE status = 'running'"),
        "finished": _one(conn, "SELECT max(id) FROM pgqueue_jobs WHERE status = 'succeeded'"),
    }


@pytest.fixture
def dashboard_session(dsn: str) -> Iterator[Conn]:
    """A session set up as the dashboard's (read-only, no parallel query, index reads)."""
    options = {**session_options(), "autocommit": False}
    with psycopg.connect(dsn, **options) as session:
        session.read_only = True
        # One transaction for the test, with the settings every dashboard transaction takes.
        session.execute(TRANSACTION_SETTINGS, {"timeout": "5000"})
        yield session


def _one(conn: Conn, query: str) -> int:
    row = conn.execute(query.encode()).fetchone()
    assert row is not None
    return int(row[0])


def _check_index_reads(plan: dict[str, Any], what: str, *, by_id: bool = True) -> None:
    """Job and dependency rows are read through an index (by id or running, if ``by_id``)."""
    for node in nodes(plan):
        relation = node.get("Relation Name")
        if relation in INDEXES:
            assert node["Node Type"] in ("Index Scan", "Index Only Scan"), (what, node)
            if by_id or relation == "pgqueue_job_deps":
                assert node["Index Name"] in INDEXES[relation], (what, node)


@pytest.mark.parametrize("generic", [True, False], ids=["generic", "custom"])
@pytest.mark.parametrize("job", ["callback", "member", "waiting", "running", "finished"])
def test_the_detail_statements_read_rows_by_index_only(
    shaped: dict[str, int], dashboard_session: Conn, job: str, generic: bool
) -> None:
    q = queries.statements("public")
    values = {"id": shaped[job], "limit": job_page.FAMILY_LIMIT, "late_after": 15.0}
    for name in ("job_detail", "job_family", "job_attempts", "job_why"):
        plan = explain(dashboard_session, q[name], values, generic=generic)
        _check_index_reads(plan, name)
        # A few index pages per row shown: never the 5,000 dependency rows of the group.
        assert buffers(plan) < 400, (name, buffers(plan))


def test_the_running_and_problems_panels_are_not_misled_by_a_big_group(
    shaped: dict[str, int], dashboard_session: Conn
) -> None:
    """Their per-row counts of parents once scanned all of pgqueue_job_deps per listed job."""
    q = queries.statements("public")
    for name in ("running_jobs", "problems"):
        for generic in (True, False):
            plan = explain(dashboard_session, q[name], {"limit": 50}, generic=generic)
            _check_index_reads(plan, name, by_id=False)
