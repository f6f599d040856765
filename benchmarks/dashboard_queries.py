"""Database time of one full dashboard refresh, and of one job detail page, on a big table.

Builds 1,000,000 finished and 100,000 waiting jobs (plus running jobs, workers, an hour of
per-second stats and schedules, limits and rate logs, a blocked job and a group callback with
20,000 parents) in a scratch database, then runs every panel's statement under EXPLAIN ANALYZE,
on a session configured like the dashboard's, and reports planning + execution time per
statement and per refresh (medians), with and without a worker's fresh depth sample; then the
same for the detail page's statements (/jobs/{id}) for jobs of every kind.

    .venv/bin/python benchmarks/dashboard_queries.py [--dsn postgresql://postgres@127.0.0.1/postgres]

The DSN names a server where the user may CREATE DATABASE; the scratch database
``pgqueue_bench_dashboard`` is dropped at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from typing import Any

import psycopg
from psycopg import conninfo, sql

from pgqueue import stats
from pgqueue.dashboard import job_page, queries, why
from pgqueue.dashboard.database import TRANSACTION_SETTINGS, Database, session_options
from pgqueue.migrate import migrate
from pgqueue.sql import named

SCRATCH = "pgqueue_bench_dashboard"
FINISHED = 1_000_000
WAITING = 100_000

BUILD = [
    # Finished: 98 % succeeded, 1 % dead, 1 % cancelled, over the last day.
    """INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, created_at, run_at,
                                claimed_at, started_at, finished_at, last_error)
       SELECT 'q' || (g % 4), 'task_' || (g % 20), jsonb_build_object('n', g, 'pad', md5(g::text)),
              (CASE WHEN g % 100 = 0 THEN 'dead' WHEN g % 100 = 1 THEN 'cancelled'
                    ELSE 'succeeded' END)::pgqueue_status,
              1, t - interval '2 s', t - interval '2 s', t - interval '1 s', t - interval '1 s', t,
              CASE WHEN g % 100 = 0 THEN 'ValueError: bad input ' || g END
       FROM (SELECT g, now() - make_interval(secs => (%(finished)s - g) * 0.0864) AS t
             FROM generate_series(1, %(finished)s) g) s""",
    # Waiting: 95 % queued, 5 % retrying, due over the next hour.
    """INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, run_at, last_error)
       SELECT 'q' || (g % 4), 'task_' || (g % 20), jsonb_build_object('n', g),
              (CASE WHEN g % 20 = 0 THEN 'retrying' ELSE 'queued' END)::pgqueue_status,
              CASE WHEN g % 20 = 0 THEN 2 ELSE 0 END,
              now() + make_interval(secs => g * 0.036),
              CASE WHEN g % 20 = 0 THEN 'TimeoutError: attempt ' || g END
       FROM generate_series(1, %(waiting)s) g""",
    """INSERT INTO pgqueue_workers (id, host, pid, concurrency)
       SELECT ('00000000-0000-4000-8000-' || lpad(g::text, 12, '0'))::uuid, 'host' || g, g, 10
       FROM generate_series(1, 4) g""",
    """INSERT INTO pgqueue_jobs (queue, task, status, attempts, lease_token, lease_expires_at,
                                worker_id, claimed_at)
       SELECT 'q' || (g % 4), 'task_' || (g % 20), 'running', 1, gen_random_uuid(),
              now() + interval '30 s',
              ('00000000-0000-4000-8000-' || lpad((1 + g % 4)::text, 12, '0'))::uuid,
              now() - make_interval(secs => g)
       FROM generate_series(1, 40) g""",
    # One hour of stats: 4 workers x 4 queues x 3600 seconds.
    """INSERT INTO pgqueue_stats (bucket, worker_id, queue, succeeded, retried, dead, lost,
                                 pickup_hist, run_hist)
       SELECT date_trunc('second', now()) - make_interval(secs => s),
              ('00000000-0000-4000-8000-' || lpad(w::text, 12, '0'))::uuid, 'q' || q,
              50, 1, 0, 0, '{"40": 30, "44": 15, "52": 5}', '{"60": 40, "64": 10}'
       FROM generate_series(0, 3599) s, generate_series(1, 4) w, generate_series(0, 3) q""",
    """INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running)
       SELECT date_trunc('second', now()) - make_interval(secs => s), 'q' || q, 23750, 1250, 10
       FROM generate_series(0, 3599) s, generate_series(0, 3) q""",
    """INSERT INTO pgqueue_schedules (name, cron, task, queue, next_run_at, last_run_at)
       SELECT 'schedule_' || g, '*/5 * * * *', 'task_1', 'q1', now() + interval '1 min',
              now() - interval '4 min' FROM generate_series(1, 20) g""",
    # For the detail page's "why": a limited and rated queue and task, with their start logs.
    """INSERT INTO pgqueue_queues (name, concurrency_limit, rate_limit, rate_period)
       VALUES ('q1', 10, 100, 60)""",
    """INSERT INTO pgqueue_tasks (name, concurrency_limit, rate_limit, rate_period)
       VALUES ('task_1', 5, 50, 60)""",
    """UPDATE pgqueue_jobs SET limit_key = '' WHERE task = 'task_1'
       AND status IN ('queued', 'retrying', 'running')""",
    """INSERT INTO pgqueue_rates (name, period, times, counts)
       SELECT n, 60, ARRAY(SELECT now() - make_interval(secs => g) FROM generate_series(1, 50) g),
              array_fill(1, ARRAY[50])
       FROM unnest(ARRAY['q:q1', 't:6:task_1:']) AS n""",
    # Attempt history (migration 0016): two failed attempts of every dead job and of every
    # twentieth succeeded one, one of every retrying job.
    """INSERT INTO pgqueue_attempts (job_id, attempt, worker_id, claimed_at, started_at,
                                    finished_at, outcome, error)
       SELECT j.id, a, '00000000-0000-4000-8000-000000000001', j.finished_at - interval '9 s',
              j.finished_at - interval '9 s', j.finished_at - make_interval(secs => 8 - a),
              CASE WHEN j.status = 'dead' AND a = 2 THEN 'dead' ELSE 'retrying' END,
              'Traceback (most recent call last):\nValueError: attempt ' || a
       FROM pgqueue_jobs j, generate_series(1, 2) a
       WHERE j.status = 'dead' OR j.status = 'succeeded' AND j.id % 20 = 0""",
    """INSERT INTO pgqueue_attempts (job_id, attempt, finished_at, outcome, error)
       SELECT id, 1, now() - interval '1 min', 'lease expired', 'LeaseExpired: worker ?'
       FROM pgqueue_jobs WHERE status = 'retrying'""",
]

#: A blocked job after three parents (two finished), and a group's callback after 20,000
#: waiting members: what after=, chains and groups write (migration 0015).
WORKFLOWS = [
    """WITH parents AS (SELECT id, row_number() OVER (ORDER BY id) AS pos FROM (
           (SELECT id FROM pgqueue_jobs WHERE status = 'succeeded' ORDER BY id DESC LIMIT 2)
           UNION ALL (SELECT id FROM pgqueue_jobs WHERE status = 'queued' ORDER BY id LIMIT 1)
       ) p), child AS (
           INSERT INTO pgqueue_jobs (queue, task, status) VALUES ('q1', 'task_1', 'blocked')
           RETURNING id
       ), waits AS (INSERT INTO pgqueue_job_waits (child_id, waiting) SELECT id, 1 FROM child)
       INSERT INTO pgqueue_job_deps (parent_id, child_id, position)
       SELECT p.id, c.id, p.pos FROM parents p, child c""",
    """WITH members AS (SELECT id, row_number() OVER (ORDER BY id) AS pos FROM pgqueue_jobs
                        WHERE status = 'queued' ORDER BY id DESC LIMIT 20000),
       callback AS (
           INSERT INTO pgqueue_jobs (queue, task, status) VALUES ('q2', 'callback', 'blocked')
           RETURNING id
       ), waits AS (INSERT INTO pgqueue_job_waits (child_id, waiting)
                    SELECT id, 20000 FROM callback)
       INSERT INTO pgqueue_job_deps (parent_id, child_id, position)
       SELECT m.id, c.id, m.pos FROM members m, callback c""",
    """UPDATE pgqueue_jobs SET has_children = true
       WHERE id IN (SELECT parent_id FROM pgqueue_job_deps)""",
]
#: The detail page's statements (job_page.read): not part of a refresh.
DETAIL = (
    "job_detail",
    "job_family",
    "job_attempts",
    "job_why",
)
#: The detail page's lookups of an archived job (run only when job_detail finds nothing).
ARCHIVED = ("archived_job_detail", "archived_job_attempts")
#: Run by a refresh only when the dead total moved, and with this many dead jobs at most every
#: 30 s (queries.DEAD_RECOUNT_SECONDS): reported on its own, not in every refresh's sum.
OCCASIONAL = ("dead_by_queue",)
#: Jobs whose page is measured, by what they are (job_why runs for waiting ones only).
DETAIL_JOBS = {
    "dead": "SELECT max(id) FROM pgqueue_jobs WHERE status = 'dead'",
    "succeeded": "SELECT max(id) FROM pgqueue_jobs WHERE status = 'succeeded'",
    "running": "SELECT min(id) FROM pgqueue_jobs WHERE status = 'running'",
    "queued, limited task": "SELECT min(id) FROM pgqueue_jobs"
    " WHERE status = 'queued' AND task = 'task_1'",
    "retrying": "SELECT min(id) FROM pgqueue_jobs WHERE status = 'retrying'",
    "blocked, 3 parents": "SELECT min(id) FROM pgqueue_jobs WHERE status = 'blocked'",
    "blocked, 20,000 parents": "SELECT max(id) FROM pgqueue_jobs WHERE status = 'blocked'",
    "a parent of 20,000's callback": "SELECT max(parent_id) FROM pgqueue_job_deps",
}


def params_for(name: str, job_id: int) -> dict[str, Any] | None:
    params: dict[str, dict[str, Any]] = {
        "running_jobs": {"limit": queries.LIST_LIMIT},
        "problems": {"limit": queries.LIST_LIMIT},
        "feed": {"limit": queries.FEED_LIMIT},
        "insert_counter": {"schema": "public"},
        "queue_settings": {"schema": "public"},
        "oldest_transaction": {"older_than": 300.0},
        # Steady state: the watermark is a few seconds old.
        "finished_since": {"after": "now"},
        "job_detail": {"id": job_id},
        "job_family": {"id": job_id, "limit": job_page.FAMILY_LIMIT},
        "job_attempts": {"id": job_id, "limit": job_page.ATTEMPTS_LIMIT + 1},
        "job_why": {"id": job_id, "late_after": 15.0},
        "depth_sampled": {"rows_per_second": stats.DEPTH_ROWS_PER_SECOND},
    }
    return params.get(name)


def explain_ms(conn: psycopg.Connection[Any], statement: bytes, params: Any) -> float:
    if params == {"after": "now"}:
        params = {"after": conn.execute("SELECT now() - interval '3 s'").fetchone()[0]}  # type: ignore[index]
    with conn.transaction():
        conn.execute(TRANSACTION_SETTINGS, {"timeout": "5000"})
        row = conn.execute(b"EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).fetchone()
    assert row is not None
    plan = row[0][0] if isinstance(row[0], list) else json.loads(row[0])[0]
    return float(plan["Planning Time"]) + float(plan["Execution Time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--refreshes", type=int, default=7)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    ident = sql.Identifier(SCRATCH)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    dsn = conninfo.make_conninfo(args.dsn, dbname=SCRATCH)
    try:
        run(dsn, args.refreshes)
    finally:
        if not args.keep:
            with psycopg.connect(args.dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def run(dsn: str, refreshes: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, "public")
        started = time.monotonic()
        for step in BUILD + WORKFLOWS:
            if "%(" in step:
                escaped = re.sub(r"%(?!\()", "%%", step)
                conn.execute(escaped, {"finished": FINISHED, "waiting": WAITING})
            else:
                conn.execute(step)
        conn.execute("VACUUM ANALYZE")
        print(f"built {FINISHED:,} finished + {WAITING:,} waiting jobs "
              f"in {time.monotonic() - started:.1f} s")  # fmt: skip
        row = conn.execute("SELECT max(id) FROM pgqueue_jobs WHERE status = 'dead'").fetchone()
        job_id = int(row[0]) if row else 1
        sample_depth = named("pgqueue", "stats.sql", "public")["sample_depth"]
        statements = queries.statements("public")
        statements = {n: v for n, v in statements.items() if n not in ARCHIVED}
        per_statement: dict[str, list[float]] = {name: [] for name in statements}
        with_workers, without_workers = [], []
        # Measured in transactions set up exactly like the dashboard's (read-only, no parallel
        # workers, no JIT).
        with psycopg.connect(dsn, **session_options()) as dashboard:
            dashboard.read_only = True
            for _ in range(refreshes):
                # What a running worker does once a second.
                conn.execute(sample_depth, {"rows_per_second": stats.DEPTH_ROWS_PER_SECOND})
                for name, statement in statements.items():
                    if name in DETAIL:
                        continue
                    ms = explain_ms(dashboard, statement, params_for(name, job_id))
                    per_statement[name].append(ms)
                refresh = {
                    n: v[-1] for n, v in per_statement.items() if n not in DETAIL + OCCASIONAL
                }
                # With a worker running, the fresh depth sample is read and nothing is counted;
                # with none, the sample query finds nothing and depth_count runs as well.
                with_workers.append(sum(v for n, v in refresh.items() if n != "depth_count"))
                without_workers.append(sum(refresh.values()))
            pages = detail_pages(conn, dashboard, statements, refreshes)
        wall = asyncio.run(wall_clock(dsn, refreshes))
    print(f"\n{'statement':<22} {'median ms':>10} {'max ms':>8}")
    for name, values in per_statement.items():
        if name in DETAIL:
            continue
        note = "  (not every refresh: see below)" if name in OCCASIONAL else ""
        print(f"{name:<22} {statistics.median(values):>10.2f} {max(values):>8.2f}{note}")
    print(f"\nDB time of one full refresh (planning + execution of every panel's statements, "
          f"median of {refreshes}):")  # fmt: skip
    for label, totals in (("workers running (fresh depth sample)", with_workers),
                          ("no worker running (depth counted)", without_workers)):  # fmt: skip
        print(f"  {label:<38} {statistics.median(totals):6.1f} ms  "
              f"(min {min(totals):.1f}, max {max(totals):.1f})")  # fmt: skip
    print(f"  {'plus, when dead jobs are recounted':<38} "
          f"{statistics.median(per_statement['dead_by_queue']):6.1f} ms  "
          "(dead total moved; at most every 30 s past 2,000 dead jobs)")  # fmt: skip
    print(f"wall clock of one refresh from Python (queries.read, round trips included): "
          f"median {statistics.median(wall):.1f} ms")  # fmt: skip
    print(f"\nDB time of one job detail page ({' + '.join(DETAIL)}), median of {refreshes}:")
    print(f"  {'job':<30} {'total ms':>9} {'max':>6}   " + "  ".join(f"{n:>10}" for n in DETAIL))
    for kind, (totals, each) in pages.items():
        medians = "  ".join(f"{statistics.median(each[n]):>10.2f}" for n in DETAIL)
        print(f"  {kind:<30} {statistics.median(totals):>9.2f} {max(totals):>6.2f}   {medians}")


def detail_pages(
    conn: psycopg.Connection[Any],
    dashboard: psycopg.Connection[Any],
    statements: dict[str, bytes],
    repeats: int,
) -> dict[str, tuple[list[float], dict[str, list[float]]]]:
    """Each kind of job's page: the three statements' time, summed per page view."""
    pages: dict[str, tuple[list[float], dict[str, list[float]]]] = {}
    for kind, query in DETAIL_JOBS.items():
        row = conn.execute(query).fetchone()
        assert row is not None and row[0] is not None, kind
        job_id = int(row[0])
        status = conn.execute("SELECT status::text FROM pgqueue_jobs WHERE id = %s", (job_id,))
        # As job_page.read: "why" only for a waiting job.
        waiting = (status.fetchone() or ("",))[0] in why.WAITING
        totals: list[float] = []
        each: dict[str, list[float]] = {name: [] for name in DETAIL}
        for _ in range(repeats):
            for name in DETAIL:
                ms = 0.0
                if waiting or name != "job_why":
                    ms = explain_ms(dashboard, statements[name], params_for(name, job_id))
                each[name].append(ms)
            totals.append(sum(each[name][-1] for name in DETAIL))
        pages[kind] = (totals, each)
    return pages


async def wall_clock(dsn: str, refreshes: int) -> list[float]:
    times = []
    database = Database(dsn)
    dead = None  # carried over as the refresh loop does: dead jobs are counted once
    try:
        for _ in range(refreshes):
            started = time.perf_counter()
            async with database.session() as conn:
                dead = (await queries.read(conn, "public", dead=dead)).dead
            times.append((time.perf_counter() - started) * 1000)
    finally:
        await database.close()
    return times


if __name__ == "__main__":
    main()
