"""The hot statements keep their cheap plans whatever the planner's statistics say.

psycopg prepares a statement after a few executions and PostgreSQL may then switch to a generic
plan, planned without the parameters' values. Two such plans once cost the worker half its speed
with many finished rows in the table: the claim's join, planned for an unknown LIMIT, became a
hash join over a sequential scan of every row; the ack, with statistics taken while nothing
ran, scanned every running row once per acked job. These tests plan each statement generically,
on a table shaped like that, and check the plan's shape.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pgqueue.sql import queries
from tests.helpers import register_worker
from tests.plans import Conn, buffers, claim_selection, explain, nodes, without_paused_lookups


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


@pytest.mark.parametrize("statement", ["claim_jobs", "claim_jobs_by_priority"])
@pytest.mark.parametrize(("finished", "queued"), [(200_000, 20_000), (300_000, 300_000)])
def test_claim_reaches_rows_by_primary_key_never_by_scanning_the_table(
    conn: Conn, finished: int, queued: int, statement: str
) -> None:
    """Also with a deep backlog: the generic plan is the one the claim keeps (next test)."""
    shape_the_table(conn, finished=finished, queued=queued, running=0)
    q = queries("public")
    worker = live_worker(conn)
    plan = explain(
        conn,
        getattr(q, statement),
        {"worker_id": worker, "limit": 200, "token": uuid.uuid4(), "tasks": None},
    )
    kinds = {n["Node Type"] for n in without_paused_lookups(plan)}
    assert "Seq Scan" not in kinds and "Hash Join" not in kinds, kinds
    scans = [n for n in without_paused_lookups(plan) if n["Node Type"] == "Index Scan"]
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
        "regroup_leases": (
            q.regroup_leases,
            {"ids": ids, "tokens": tokens, "keys": [""] * len(ids)},
        ),
    }
    statements["complete_jobs_skip_locked"] = (
        q.complete_jobs_skip_locked, statements["complete_jobs"][1]
    )  # fmt: skip
    for name, (statement, values) in statements.items():
        plan = explain(conn, statement, values)
        assert plan["Actual Rows"] == (0 if name == "extend_leases" else n), name
        for node in nodes(plan):
            # Every node handles at most the batch: no scan of all running rows per element.
            rows = node["Actual Rows"] * node.get("Actual Loops", 1)
            assert rows <= n, (name, node["Node Type"], rows)
            assert node["Node Type"] != "Seq Scan" or node.get("Relation Name") != "pgqueue_jobs"


@pytest.mark.parametrize("statement", ["claim_jobs", "claim_jobs_by_priority"])
def test_the_claim_is_planned_once_not_at_every_execution(conn: Conn, statement: str) -> None:
    """Its LIMIT hides behind a subquery (see claim_jobs), so PostgreSQL keeps the generic plan
    once psycopg has prepared the statement, instead of planning every claim anew."""
    shape_the_table(conn, finished=10_000, queued=5_000, running=0)
    q = queries("public")
    worker = live_worker(conn)
    for limit in range(40, 60):
        params = {"worker_id": worker, "limit": limit, "token": uuid.uuid4(), "tasks": None}
        assert len(conn.execute(getattr(q, statement), params).fetchall()) == limit
    (row,) = conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement LIKE 'WITH claimed AS%%' AND (statement LIKE '%%RECURSIVE%%') = %s",
        (statement == "claim_jobs_by_priority",),
    ).fetchall()
    generic, custom = row
    assert custom <= 5 and generic >= 10, (generic, custom)


def shape_with_delayed_jobs(conn: Conn, due: int, delayed: int) -> None:
    """Due jobs at three priorities in two queues, delayed ones at five priorities between and
    above them, in three queues; statistics taken."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority)"
        " SELECT CASE WHEN g %% 2 = 0 THEN 'a' ELSE 'b' END, 't', (g %% 3) * 10"
        " FROM generate_series(1, %s) AS g",
        (due,),
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority, run_at)"
        " SELECT CASE g %% 3 WHEN 0 THEN 'a' WHEN 1 THEN 'b' ELSE 'c' END, 't', (g %% 5) * 10 + 5,"
        "        now() + interval '1 hour' + g * interval '1 ms'"
        " FROM generate_series(1, %s) AS g",
        (delayed,),
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")


def locks_lazily(selection: dict[str, Any], limit: int) -> None:
    """Rows are locked only as the claim's LIMIT pulls them: every LockRows sits under a Limit
    with no Sort above it (a Sort would pull, and lock, every due row first), and no node hands
    on more than the batch."""

    def check(node: dict[str, Any], sorted_above: bool) -> None:
        kind = node["Node Type"]
        assert not (kind == "LockRows" and sorted_above), "a Sort above the row locks"
        assert node["Actual Rows"] <= limit, (kind, node["Actual Rows"])
        for child in node.get("Plans", []):
            check(child, sorted_above or kind == "Sort")

    check(selection, False)
    assert any(n["Node Type"] == "LockRows" for n in nodes(selection))


def due_row_scans(selection: dict[str, Any]) -> list[dict[str, Any]]:
    """The scans under the row locks that ran: those that read the due rows. (The claim has two
    sets of locks: one under the walk over the priorities, one under the scan of the rest.)"""
    (locks,) = [
        n for n in nodes(selection) if n["Node Type"] == "LockRows" and n["Actual Loops"] > 0
    ]
    return [n for n in nodes(locks) if n["Node Type"] in SCANS]


SCANS = {"Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Seq Scan"}
BATCH = 200


def claim_a_batch(conn: Conn, statement: bytes, queues: list[str] | None = None) -> dict[str, Any]:
    """Run one claim of ``BATCH`` jobs under EXPLAIN ANALYZE, as a worker would (the all-queues
    statement on its cached generic plan, a queue list on custom ones), check that it took a
    full batch and locked nothing beyond it, and return the part of the plan that chose it."""
    params: dict[str, Any] = {
        "worker_id": live_worker(conn), "limit": BATCH, "token": uuid.uuid4(), "tasks": None
    }  # fmt: skip
    if queues is not None:
        params["queues"] = queues
    plan = explain(conn, statement, params, generic=queues is None)
    assert plan["Actual Rows"] == BATCH
    selection = claim_selection(plan)
    locks_lazily(selection, BATCH)
    return selection


def test_claim_by_priority_walks_the_priorities_and_reads_no_delayed_row(conn: Conn) -> None:
    """The generic plan at depth, delayed jobs between and above the due ones: one index
    descent per priority (each probe returns one row), the due rows of a priority read in order
    from the ready index bounded by run_at, and nothing locked beyond the batch."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=300_000)
    selection = claim_a_batch(conn, queries("public").claim_jobs_by_priority)
    (scan,) = due_row_scans(selection)
    assert scan["Node Type"] == "Index Scan" and scan["Index Name"] == "pgqueue_jobs_ready_idx"
    assert "priority = " in scan["Index Cond"] and "run_at <= now()" in scan["Index Cond"], scan
    probes = [n for n in nodes(selection) if n["Node Type"] == "Index Only Scan"]
    assert probes and all(n["Actual Rows"] <= 1 for n in probes), probes
    assert buffers(selection) < 600  # 200 row locks, a few descents


@pytest.mark.parametrize("queues", [["a"], ["a", "b"]])
def test_claim_by_priority_in_queues_probes_each_queue_and_one_queue_reads_its_own_index(
    conn: Conn, queues: list[str]
) -> None:
    """The list variant runs on custom plans (it keeps a plain LIMIT parameter). It probes each
    listed queue in pgqueue_jobs_ready_queue_idx, and for a single queue reads the due rows
    there too, by equality and in order; for several, from the ready index filtered by queue."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=300_000)
    selection = claim_a_batch(conn, queries("public").claim_jobs_by_priority_in_queues, queues)
    probes = [n for n in nodes(selection) if n["Node Type"] == "Index Only Scan"]
    assert {n["Index Name"] for n in probes} == {"pgqueue_jobs_ready_queue_idx"}
    assert all(n["Actual Rows"] <= 1 for n in probes), probes
    (scan,) = due_row_scans(selection)
    assert scan["Node Type"] == "Index Scan" and "run_at <= now()" in scan["Index Cond"], scan
    if len(queues) == 1:
        assert scan["Index Name"] == "pgqueue_jobs_ready_queue_idx"
        assert "queue = 'a'::text" in scan["Index Cond"], scan
    assert buffers(selection) < 600


def test_claim_by_priority_beyond_32_priorities_scans_the_rest_in_one_pass(conn: Conn) -> None:
    """With many distinct priorities the walk stops after 32 of them (32 descents) and the rest
    is read as before the walk existed, in one ordered pass: a claim never costs much more than
    that pass, however many priorities there are."""
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority) SELECT 'q', 't', 0"
        " FROM generate_series(1, 20000)"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority, run_at)"
        " SELECT 'q', 't', 1 + g %% 1000, now() + interval '1 hour' FROM generate_series(1, %s) g",
        (100_000,),
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    selection = claim_a_batch(conn, queries("public").claim_jobs_by_priority)
    (probe,) = [n for n in nodes(selection) if n["Node Type"] == "Index Only Scan"]
    assert probe["Actual Loops"] == 32
    (scan,) = due_row_scans(selection)
    assert scan["Node Type"] == "Index Scan" and scan["Index Name"] == "pgqueue_jobs_ready_idx"
    assert "priority < " in scan["Index Cond"] and "run_at <= now()" in scan["Index Cond"], scan
    # The pass over ~97,000 delayed entries (~500 buffers), 200 row locks, 32 descents.
    assert buffers(selection) < 1_300, buffers(selection)


@pytest.mark.parametrize("queues", [None, ["a"]])
def test_plain_claim_reads_the_due_rows_in_one_ordered_scan(
    conn: Conn, queues: list[str] | None
) -> None:
    """What a worker claims with while no job waits for a later run_at: one range scan in claim
    order that stops after the batch (for one queue, in that queue's index), nothing else."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=0)
    q = queries("public")
    statement = q.claim_jobs if queues is None else q.claim_jobs_in_queues
    selection = claim_a_batch(conn, statement, queues)
    (scan,) = [
        n for n in nodes(selection)
        if n["Node Type"] in SCANS and n.get("Relation Name") == "pgqueue_jobs"
    ]  # fmt: skip
    assert scan["Node Type"] == "Index Scan", scan
    index = "pgqueue_jobs_ready_idx" if queues is None else "pgqueue_jobs_ready_queue_idx"
    assert scan["Index Name"] == index and scan["Actual Rows"] == BATCH, scan
    assert buffers(selection) < 500


@pytest.mark.parametrize("queues", [None, ["c"], ["a", "c"]])
def test_next_ready_at_costs_a_few_descents_per_priority_at_any_depth(
    conn: Conn, queues: list[str] | None
) -> None:
    """One or two index descents per distinct priority (per listed queue), whatever the depth."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=300_000)
    q = queries("public")
    statement = q.next_ready_at if queues is None else q.next_ready_at_in_queues
    plan = explain(conn, statement, {"queues": queues, "lookback": 0.05})
    assert buffers(plan) < 150, buffers(plan)
    for node in without_paused_lookups(plan):
        assert node["Node Type"] != "Seq Scan" and node["Node Type"] != "Bitmap Heap Scan", node
        assert node["Actual Rows"] <= 10, node  # one row per priority, at most


def pause(conn: Conn, queue: str) -> None:
    conn.execute("INSERT INTO pgqueue_queues (name, paused) VALUES (%s, true)", (queue,))


@pytest.mark.parametrize("queues", [None, ["a", "b"]])
def test_a_paused_queue_is_skipped_by_one_lookup_per_claim_in_the_same_ordered_scan(
    conn: Conn, queues: list[str] | None
) -> None:
    """Half the due jobs are in a paused queue: the claim still takes a full batch in one range
    scan in claim order, reading the paused rows it meets (the batch's worth), and looks the
    paused queues up once (without_paused_lookups checks it), not per row."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=0)
    pause(conn, "a")
    q = queries("public")
    statement = q.claim_jobs if queues is None else q.claim_jobs_in_queues
    selection = claim_a_batch(conn, statement, queues)
    (scan,) = [
        n for n in without_paused_lookups(selection)
        if n["Node Type"] in SCANS and n.get("Relation Name") == "pgqueue_jobs"
    ]  # fmt: skip
    assert scan["Node Type"] == "Index Scan" and scan["Index Name"] == "pgqueue_jobs_ready_idx"
    assert scan["Actual Rows"] == BATCH and 0 < scan["Rows Removed by Filter"] <= 2 * BATCH, scan
    assert buffers(selection) < 600


@pytest.mark.parametrize(
    "statement",
    ["claim_jobs_in_queues", "claim_jobs_by_priority_in_queues", "next_ready_at_in_queues"],
)
def test_a_worker_whose_queues_are_all_paused_reads_none_of_their_jobs(
    conn: Conn, statement: str
) -> None:
    """A worker serving only paused queues costs one lookup per claim, however deep their
    backlog: the check on its queue list is a one-time filter, not a scan that skips every row."""
    shape_with_delayed_jobs(conn, due=30_000, delayed=30_000)
    pause(conn, "a")
    pause(conn, "c")
    params = {
        "worker_id": live_worker(conn), "limit": BATCH, "token": uuid.uuid4(), "tasks": None,
        "queues": ["a", "c"], "lookback": 0.05,
    }  # fmt: skip
    plan = explain(conn, getattr(queries("public"), statement), params, generic=False)
    for node in without_paused_lookups(plan):
        if node.get("Relation Name") == "pgqueue_jobs" and node.get("Index Name") != (
            "pgqueue_jobs_pkey"
        ):
            assert node["Actual Rows"] == 0, node
    assert buffers(plan) < 20, buffers(plan)
