"""Database time of one full dashboard refresh on a big table.

Builds 1,000,000 finished and 100,000 waiting jobs (plus running jobs, workers, an hour of
per-second stats and schedules) in a scratch database, then runs every panel's statement under
EXPLAIN ANALYZE, on a session configured like the dashboard's, and reports planning + execution
time per statement and per refresh (medians), with and without a worker's fresh depth sample.

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
from pgqueue.dashboard import queries
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
]


def params_for(name: str, job_id: int) -> dict[str, Any] | None:
    params: dict[str, dict[str, Any]] = {
        "running_jobs": {"limit": queries.LIST_LIMIT},
        "problems": {"limit": queries.LIST_LIMIT},
        "feed": {"limit": queries.FEED_LIMIT},
        "insert_counter": {"schema": "public"},
        # Steady state: the watermark is a few seconds old.
        "finished_since": {"after": "now"},
        "job_detail": {"id": job_id},
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
        for step in BUILD:
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
                    ms = explain_ms(dashboard, statement, params_for(name, job_id))
                    per_statement[name].append(ms)
                refresh = {n: v[-1] for n, v in per_statement.items() if n != "job_detail"}
                # With a worker running, the fresh depth sample is read and nothing is counted;
                # with none, the sample query finds nothing and depth_count runs as well.
                with_workers.append(sum(v for n, v in refresh.items() if n != "depth_count"))
                without_workers.append(sum(refresh.values()))
        wall = asyncio.run(wall_clock(dsn, refreshes))
    print(f"\n{'statement':<22} {'median ms':>10} {'max ms':>8}")
    for name, values in per_statement.items():
        print(f"{name:<22} {statistics.median(values):>10.2f} {max(values):>8.2f}")
    print(f"\nDB time of one full refresh (planning + execution of every panel's statements, "
          f"median of {refreshes}):")  # fmt: skip
    for label, totals in (("workers running (fresh depth sample)", with_workers),
                          ("no worker running (depth counted)", without_workers)):  # fmt: skip
        print(f"  {label:<38} {statistics.median(totals):6.1f} ms  "
              f"(min {min(totals):.1f}, max {max(totals):.1f})")  # fmt: skip
    print(f"wall clock of one refresh from Python (queries.read, round trips included): "
          f"median {statistics.median(wall):.1f} ms")  # fmt: skip


async def wall_clock(dsn: str, refreshes: int) -> list[float]:
    times = []
    database = Database(dsn)
    try:
        for _ in range(refreshes):
            started = time.perf_counter()
            async with database.session() as conn:
                await queries.read(conn, "public")
            times.append((time.perf_counter() - started) * 1000)
    finally:
        await database.close()
    return times


if __name__ == "__main__":
    main()
