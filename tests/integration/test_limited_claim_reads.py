"""What a limited claim reads once many jobs have run since the last vacuum.

Every job that ran leaves an entry in the running jobs' indexes pointing at a dead row version,
until vacuum (autovacuum looks at a database about once a minute). The limited claim counts the
running jobs of its groups through those indexes in each of its two statements; a count planned
as a bitmap scan visits every dead version's row, every claim, and a drain of a large limited
backlog slowed as it went (a queue limited to 100: 6,500 jobs/s over 300,000 jobs, against
17,000). The claim's transaction turns bitmap and sequential scans off, and JIT with them
(limit_claim_settings): a plain index scan marks the dead entries as it passes them and later
claims step over them.

A scan marks an entry dead only once no transaction on the whole server could still see its row
version: any transaction of any database with an older xid holds that back, and the suite's other
tests run such transactions all the time on the shared server (their handlers' transactions, the
fault suite's workers). So these tests run on a cluster of their own, where nothing else runs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.sql import queries
from pgqueue.testing.databases import TemplateDatabases
from pgqueue.worker.fetcher import read_head
from tests.helpers import (
    begin_limited_claim,
    limited_claim_params,
    limited_walk_params,
    own_cluster,
    register_worker,
)

Conn = psycopg.Connection[Any]

JOBS = 20_000
RAN = 15_000
RUNNING = 500
RUNNING_INDEXES = ("pgqueue_jobs_running_idx", "pgqueue_jobs_running_limited_idx")


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[TemplateDatabases]:
    """A cluster for this module alone (see the module's docstring)."""
    with own_cluster("claim-reads") as server:
        yield server


@pytest.fixture
def dsn(quiet_server: TemplateDatabases) -> Iterator[str]:
    """A fresh, migrated database on the module's own cluster (``app`` and ``conn`` use it)."""
    with quiet_server.database() as database:
        yield database


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def _explained(c: Conn, statement: bytes, params: dict[str, Any]) -> dict[str, Any]:
    row = c.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params).fetchone()
    assert row is not None
    value = row[0]
    explained: dict[str, Any] = (json.loads(value) if isinstance(value, str) else value)[0]
    # The settings cost a scan the plan cannot avoid (pgqueue_queues, read whole) as disabled,
    # which puts the estimate above jit_above_cost: JIT compiled the walk on every claim.
    assert "JIT" not in explained, "the limited claim was compiled by JIT"
    plan: dict[str, Any] = explained["Plan"]
    return plan


def _limited_claim(c: Conn, worker: uuid.UUID, tasks: list[str]) -> list[dict[str, Any]]:
    """The fetcher's limited claim (Fetcher.claim_limited: the same statements in the same
    transaction), each statement explained; returns both plans."""
    q = queries("public")
    locks = begin_limited_claim(c, tasks)
    try:
        # The walk again, explained in the same transaction (its locks are the session's own).
        first = _explained(c, q.lock_limit_groups, limited_walk_params(tasks))
        second = _explained(c, q.claim_limited_jobs, limited_claim_params(worker, tasks, locks, 50))
    finally:
        c.execute("COMMIT")
    return [first, second]


def _head_claim(c: Conn, worker: uuid.UUID, tasks: list[str]) -> list[dict[str, Any]]:
    """The fetcher's limited claim from the head of the queue (Fetcher.claim_head), each
    statement explained; returns both plans."""
    q = queries("public")
    begin_limited_claim(c, tasks)  # the transaction and its settings (and a walk, unexplained)
    try:
        head = {"schema": "public", "queues": None, "tasks": tasks, "scan": 200}
        first = _explained(c, q.lock_head_groups, head)
        ids, keys, _, _ = read_head(c.execute(q.lock_head_groups, head).fetchall(), 100)
        claim = {"worker_id": worker, "token": uuid.uuid4(), "ids": ids, "keys": keys}
        second = _explained(c, q.claim_head_jobs, claim)
    finally:
        c.execute("COMMIT")
    return [first, second]


@pytest.mark.parametrize("limit", ["queue", "key", "head"])
def test_a_limited_claim_steps_over_the_jobs_that_ran_since_the_last_vacuum(
    app: pgqueue.App, conn: Conn, limit: str
) -> None:
    @app.task(name="keyed", limit=1, limit_key=lambda args: args["n"] % 50)
    async def keyed(n: int) -> None: ...

    conn.execute("ALTER TABLE pgqueue_jobs SET (autovacuum_enabled = false)")
    if limit == "queue":
        app.limit_queue("limited", limit=50)
        app.enqueue_many(
            [{"task": "plain", "queue": "limited", "args": {"n": n}} for n in range(JOBS)],
            allow_unknown=True,
        )
        tasks = ["plain"]
    else:
        app.enqueue_many([("keyed", {"n": n}) for n in range(JOBS)])
        tasks = ["keyed"]
    if limit == "head":  # the task's limit as its workers declare it (the head reads it)
        conn.execute(
            queries("public").declare_task_limits,
            {"names": ["keyed"], "limits": [1], "rate_limits": [None], "rate_periods": [None],
             "per_keys": [True]},
        )  # fmt: skip
    worker = uuid.uuid4()
    register_worker(conn, worker, lease=300)
    # RAN jobs run and finish, each leaving a dead version behind its entries in the running
    # jobs' indexes; statistics are taken while RUNNING of them run, as autovacuum's analyze
    # does while a backlog drains.
    for first, count in ((0, RAN - RUNNING), (RAN - RUNNING, RUNNING)):
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'running' WHERE id IN"
            " (SELECT id FROM pgqueue_jobs ORDER BY id OFFSET %s LIMIT %s)",
            (first, count),
        )
        if first:
            conn.execute("ANALYZE pgqueue_jobs")
        conn.execute(
            "UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now()"
            " WHERE status = 'running'"
        )
    claim = _head_claim if limit == "head" else _limited_claim
    with psycopg.connect(conn.info.dsn, autocommit=True) as c:
        claim(c, worker, tasks)
        c.execute("UPDATE pgqueue_jobs SET status = 'queued' WHERE status = 'running'")
        plans = claim(c, worker, tasks)
    nodes = [node for plan in plans for node in _nodes(plan)]
    whole = [f"{n['Node Type']} ({n.get('Index Name', 'the table')})" for n in nodes
             if n["Node Type"] in ("Bitmap Heap Scan", "Seq Scan")
             and n.get("Relation Name") == "pgqueue_jobs"]  # fmt: skip
    assert not whole, f"the limited claim read pgqueue_jobs by {whole}"
    assert plans[1]["Actual Rows"] == 50  # it claimed
    # The counts of running jobs: a bitmap scan would visit the heap page of every dead version
    # (RAN of them, hundreds of pages), every claim; stepping over the entries the first claim
    # marked reads a few dozen index pages.
    counted = sum(n["Shared Hit Blocks"] + n["Shared Read Blocks"] for n in nodes
                  if n.get("Index Name") in RUNNING_INDEXES)  # fmt: skip
    assert counted < 200, f"the counts of running jobs read {counted} pages"


@pytest.mark.parametrize("analyzed", [False, True])
def test_a_claim_from_the_head_reaches_its_jobs_by_primary_key(
    app: pgqueue.App, conn: Conn, analyzed: bool
) -> None:
    """claim_head_jobs is given the ids of the jobs it may take: one probe of the primary key
    each, whatever the statistics. Planned as a join of the ids with the table, it read every
    waiting job (a drain's fresh table, never analyzed: 30,000 entries of
    pgqueue_jobs_ready_queue_idx, 11 ms of a 14 ms claim of 100)."""

    @app.task(name="keyed", limit=1, limit_key=lambda args: args["n"] % 100)
    async def keyed(n: int) -> None: ...

    q = queries("public")
    conn.execute("ALTER TABLE pgqueue_jobs SET (autovacuum_enabled = false)")
    app.enqueue_many([("keyed", {"n": n}) for n in range(JOBS)])
    if analyzed:
        conn.execute("ANALYZE pgqueue_jobs")
    conn.execute(
        q.declare_task_limits,
        {"names": ["keyed"], "limits": [1], "rate_limits": [None], "rate_periods": [None],
         "per_keys": [True]},
    )  # fmt: skip
    worker = uuid.uuid4()
    register_worker(conn, worker, lease=300)
    with psycopg.connect(conn.info.dsn, autocommit=True) as c:
        plans = _head_claim(c, worker, ["keyed"])
    assert plans[1]["Actual Rows"] == 100  # it claimed
    read = {
        n.get("Index Name", n["Node Type"])
        for n in _nodes(plans[1])
        if n.get("Relation Name") == "pgqueue_jobs" and n["Node Type"] != "ModifyTable"
    }
    assert read - set(RUNNING_INDEXES) == {"pgqueue_jobs_pkey"}, read
