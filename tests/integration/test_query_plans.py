"""The hot statements keep their cheap plans whatever the planner's statistics say.

psycopg prepares a statement after a few executions and PostgreSQL may then switch to a generic
plan, planned without the parameters' values. Two such plans once cost the worker half its speed
with many finished rows in the table: the claim's join, planned for an unknown LIMIT, became a
hash join over a sequential scan of every row; the ack, with statistics taken while nothing
ran, scanned every running row once per acked job. These tests plan each statement generically,
on a table shaped like that, and check the plan's shape.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import psycopg
import pytest

from pgqueue.sql import queries
from tests.helpers import register_worker

Conn = psycopg.Connection[tuple[Any, ...]]


def generic_plan(conn: Conn, statement: bytes, values: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN ANALYZE of ``statement`` as a server-side prepared statement planned generically,
    inside a transaction that is rolled back."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)[sb]", number, statement.decode())
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE hot AS {text}".encode())
        try:
            # EXECUTE takes no bound parameters: a client-side cursor writes them in as literals.
            placeholders = ", ".join(["%s"] * len(names))
            cur = psycopg.ClientCursor(conn)
            cur.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE hot({placeholders})".encode(),
                [values[n] for n in names],
            )
            row = cur.fetchone()
        finally:
            conn.execute("DEALLOCATE hot")
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return dict(plan[0]["Plan"])


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def live_worker(conn: Conn) -> uuid.UUID:
    """A registered worker with a live lease: claims take nothing without one."""
    worker = uuid.uuid4()
    register_worker(conn, worker)
    return worker


def shape_the_table(conn: Conn, finished: int, queued: int, running: int) -> None:
    """Many finished rows, statistics taken with nothing running, then jobs in flight."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, finished_at)"
        " SELECT 'q', 't', 'succeeded', 1, now() FROM generate_series(1, %s)",
        (finished,),
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'q', 't' FROM generate_series(1, %s)",
        (queued,),
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running', attempts = 1, lease_token = gen_random_uuid(),"
        " lease_expires_at = now() + interval '1 minute'"
        " WHERE id IN (SELECT id FROM pgqueue_jobs WHERE status = 'queued' LIMIT %s)",
        (running,),
    )


@pytest.mark.parametrize(("finished", "queued"), [(200_000, 20_000), (300_000, 300_000)])
def test_claim_reaches_rows_by_primary_key_never_by_scanning_the_table(
    conn: Conn, finished: int, queued: int
) -> None:
    """Also with a deep backlog: the generic plan is the one the claim keeps (next test)."""
    shape_the_table(conn, finished=finished, queued=queued, running=0)
    q = queries("public")
    worker = live_worker(conn)
    plan = generic_plan(
        conn,
        q.claim_jobs,
        {"worker_id": worker, "limit": 200, "token": uuid.uuid4(), "tasks": None},
    )
    kinds = {n["Node Type"] for n in nodes(plan)}
    assert "Seq Scan" not in kinds and "Hash Join" not in kinds, kinds
    scans = [n for n in nodes(plan) if n["Node Type"] == "Index Scan"]
    # The worker's own row, read once per claim: its lease must be live.
    assert {n["Index Name"] for n in scans} == {
        "pgqueue_jobs_ready_idx", "pgqueue_jobs_pkey", "pgqueue_workers_pkey"
    }  # fmt: skip
    assert max(n["Actual Rows"] for n in nodes(plan)) <= 200


def test_ack_heartbeat_and_release_probe_each_job_once(conn: Conn) -> None:
    shape_the_table(conn, finished=60_000, queued=3_000, running=400)
    held = conn.execute(
        "SELECT id, lease_token FROM pgqueue_jobs WHERE status = 'running' ORDER BY id LIMIT 200"
    ).fetchall()
    ids, tokens = [r[0] for r in held], [r[1] for r in held]
    n = len(ids)
    q = queries("public")
    statements: dict[str, tuple[bytes, dict[str, Any]]] = {
        "complete_jobs": (
            q.complete_jobs,
            {
                "lock_timeout": "100ms",
                "ids": ids,
                "tokens": tokens,
                "statuses": ["succeeded"] * n,
                "delays": [0.0] * n,
                "errors": [None] * n,
                "results": [None] * n,
                "run_seconds": [0.001] * n,
            },
        ),
        "extend_leases": (
            q.extend_leases,
            {
                "ids": ids,
                "tokens": tokens,
                "lease": 30.0,
                "worker_id": uuid.uuid4(),
                "host": "h",
                "pid": 1,
                "queues": None,
                "concurrency": 1,
                "stale_writes": 0,
            },
        ),
        "release_leases": (q.release_leases, {"ids": ids, "tokens": tokens}),
    }
    statements["complete_jobs_skip_locked"] = (
        q.complete_jobs_skip_locked, statements["complete_jobs"][1]
    )  # fmt: skip
    for name, (statement, values) in statements.items():
        plan = generic_plan(conn, statement, values)
        assert plan["Actual Rows"] == (0 if name == "extend_leases" else n), name
        for node in nodes(plan):
            # Every node handles at most the batch: no scan of all running rows per element.
            rows = node["Actual Rows"] * node.get("Actual Loops", 1)
            assert rows <= n, (name, node["Node Type"], rows)
            assert node["Node Type"] != "Seq Scan" or node.get("Relation Name") != "pgqueue_jobs"


def test_the_claim_is_planned_once_not_at_every_execution(conn: Conn) -> None:
    """Its LIMIT hides behind a subquery (see claim_jobs), so PostgreSQL keeps the generic plan
    once psycopg has prepared the statement, instead of planning every claim anew."""
    shape_the_table(conn, finished=10_000, queued=5_000, running=0)
    q = queries("public")
    worker = live_worker(conn)
    for limit in range(40, 60):
        params = {"worker_id": worker, "limit": limit, "token": uuid.uuid4(), "tasks": None}
        assert len(conn.execute(q.claim_jobs, params).fetchall()) == limit
    row = conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
        ("%One statement claims a batch%",),
    ).fetchone()
    assert row is not None
    generic, custom = row
    assert custom <= 5 and generic >= 10, (generic, custom)
