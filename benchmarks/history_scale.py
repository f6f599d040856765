"""Does a big history slow the hot path? Claims, acks and a dashboard refresh on a table holding
10,000,000 finished and 1,000,000 delayed jobs, side by side with an empty one; what history
costs on disk; what one retention batch costs; WAL bytes per job.

    .venv/bin/python benchmarks/history_scale.py [--finished 10000000] [--delayed 1000000]
    .venv/bin/python benchmarks/history_scale.py --wal-only     # WAL per job, pruned, archived
    .venv/bin/python benchmarks/history_scale.py --queues-only  # claim time by queue count

Starts a throwaway PostgreSQL (or uses ``--dsn``, a server where the user may CREATE DATABASE)
with two scratch databases, ``empty`` and ``full``, both migrated. ``full`` is filled with
INSERT ... SELECT generate_series (98 % succeeded, 1 % dead, 1 % cancelled, finished over the
last day; delayed jobs due over the next day) and VACUUM ANALYZEd. Then, in alternating rounds
so that both see the same machine: 100 due jobs are inserted, claimed 10 at a time with the
worker's own statements (claim_jobs_by_priority, as the fetcher does while jobs are delayed,
and claim_jobs) and acked 10 at a time (complete_jobs); each statement's wall time from Python
is recorded (medians). A dashboard refresh is every panel's statement under EXPLAIN ANALYZE, as
benchmarks/dashboard_queries.py measures it. Finally a VACUUM of each table after the same
churn, one prune batch (prune_finished_jobs) on the full table, a million of its jobs moved to
the archive (archive_finished_jobs) and their size there, and WAL per job on the empty one.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dashboard_queries import DETAIL, OCCASIONAL, explain_ms, params_for
from pgqueue import stats
from pgqueue.dashboard import queries as dashboard_queries
from pgqueue.dashboard.database import session_options
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from pgqueue.sql import named, queries

SAMPLE_DEPTH = named("pgqueue", "stats.sql", "public")["sample_depth"]

KEYS = ("empty", "delayed", "full")
WORKER = uuid.UUID("00000000-0000-4000-8000-000000000001")

FILL_FINISHED = """
INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, created_at, run_at, claimed_at,
                          started_at, finished_at, last_error, result, lease_token)
SELECT 'q' || (g %% 4), 'task_' || (g %% 20), jsonb_build_object('n', g, 'user', md5(g::text)),
       (CASE WHEN g %% 100 = 0 THEN 'dead' WHEN g %% 100 = 1 THEN 'cancelled'
             ELSE 'succeeded' END)::pgqueue_status,
       1, t - interval '2 s', t - interval '2 s', t - interval '1 s', t - interval '1 s', t,
       CASE WHEN g %% 100 = 0 THEN 'ValueError: bad input ' || g END,
       CASE WHEN g %% 100 > 1 THEN '{"ok": true}'::jsonb END, gen_random_uuid()
FROM (SELECT g, now() - make_interval(secs => (%(n)s - g) * (86400.0 / %(n)s)) AS t
      FROM generate_series(1, %(n)s) g) s
"""
FILL_DELAYED = """
INSERT INTO pgqueue_jobs (queue, task, args, run_at)
SELECT 'q' || (g %% 4), 'task_' || (g %% 20), jsonb_build_object('n', g),
       now() + interval '1 hour' + make_interval(secs => g * (86400.0 / %(n)s))
FROM generate_series(1, %(n)s) g
"""
DUE = """
INSERT INTO pgqueue_jobs (queue, task, args)
SELECT 'q' || (g %% 4), 'task_' || (g %% 20), jsonb_build_object('n', g)
FROM generate_series(1, %(n)s) g
"""
LIVE_WORKER = """
INSERT INTO pgqueue_workers (id, host, pid, concurrency, lease_expires_at)
VALUES (%(id)s, 'bench', 1, 10, now() + interval '1 day')
ON CONFLICT (id) DO UPDATE SET lease_expires_at = now() + interval '1 day'
"""
ARCHIVE_SIZE = """
SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits
WHERE inhparent = 'pgqueue_jobs_archive'::regclass
"""
SIZE = """
SELECT pg_table_size('pgqueue_jobs'), pg_indexes_size('pgqueue_jobs'),
       pg_total_relation_size('pgqueue_jobs')
"""


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def run_statement(conn: psycopg.Connection[Any], statement: bytes | str, params: Any) -> Any:
    return conn.execute(re.sub(r"%(?!\()", "%%", statement) if isinstance(statement, str)
                        else statement, params)  # fmt: skip


def round_of_work(
    conn: psycopg.Connection[Any],
    q: Any,
    claim: bytes,
    times: dict[str, list[float]],
    key: str,
    batch: int = 10,
) -> None:
    """100 due jobs in, claimed and acked ``batch`` at a time; each statement timed."""
    conn.execute(DUE, {"n": 100})
    while True:
        token = uuid.uuid4()
        started = time.perf_counter()
        rows = conn.execute(
            claim, {"worker_id": WORKER, "limit": batch, "token": token, "tasks": None}
        ).fetchall()
        times[f"{key} claim"].append(ms_since(started))
        if not rows:
            break
        ids = sorted(int(r[0]) for r in rows)
        params = {
            "lock_timeout": "100ms",
            "ids": ids,
            "tokens": [token] * len(ids),
            "statuses": ["succeeded"] * len(ids),
            "delays": [0.0] * len(ids),
            "errors": [None] * len(ids),
            "results": [None] * len(ids),
            "run_seconds": [0.001] * len(ids),
        }
        started = time.perf_counter()
        done = conn.execute(q.complete_jobs, params).fetchall()
        times[f"{key} ack"].append(ms_since(started))
        assert len(done) == len(ids), "an ack was refused"


def refresh_ms(
    conn: psycopg.Connection[Any], dashboard: psycopg.Connection[Any]
) -> dict[str, float]:
    """One full dashboard refresh's database time per statement (planning + execution), after
    the depth sample a running worker writes every second (as dashboard_queries.py does)."""
    conn.execute(SAMPLE_DEPTH, {"rows_per_second": stats.DEPTH_ROWS_PER_SECOND})
    return {
        name: explain_ms(dashboard, statement, params_for(name, 1))
        for name, statement in dashboard_queries.statements("public").items()
        if name not in DETAIL and name not in OCCASIONAL
    }


def wal_per_job(conn: psycopg.Connection[Any], q: Any, jobs: int, batch: int) -> dict[str, float]:
    """WAL bytes per job through enqueue (100 per statement), claim and ack (``batch`` per
    statement): right after a CHECKPOINT (every page's first change writes a full image of it),
    and again at once (the same pages, images already written)."""
    conn.execute("CHECKPOINT")
    figures = {}
    for label in ("after_checkpoint", "steady"):
        start = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        sink: dict[str, list[float]] = {"w claim": [], "w ack": []}
        for _ in range(jobs // 100):
            round_of_work(conn, q, q.claim_jobs, sink, "w", batch)
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start]).fetchone()
        figures[label] = float(row[0]) / jobs  # type: ignore[index]
    return figures


def wal_figures(conn: psycopg.Connection[Any], q: Any) -> dict[int, dict[str, float]]:
    wal = {batch: wal_per_job(conn, q, 10_000, batch) for batch in (1, 10, 100)}
    print("WAL bytes per job (enqueue 100 per statement; claim and ack N per statement):")
    for batch, w in wal.items():
        print(f"  N = {batch:3}: {w['after_checkpoint']:6,.0f} after a checkpoint, "
              f"{w['steady']:6,.0f} steady")  # fmt: skip
    return wal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="use this server instead of a throwaway one")
    parser.add_argument("--finished", type=int, default=10_000_000)
    parser.add_argument("--delayed", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=60, help="rounds of 100 jobs per table")
    parser.add_argument("--refreshes", type=int, default=9)
    parser.add_argument("--archive-rows", type=int, default=1_000_000, help="jobs to archive")
    parser.add_argument("--wal-only", action="store_true", help="only WAL per job")
    parser.add_argument("--queues-only", action="store_true", help="only claims by queue count")
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args()
    cluster = None
    if args.dsn is None:
        cluster = EmbeddedPostgres().start()
        admin_dsn = cluster.dsn
    else:
        admin_dsn = args.dsn
    try:
        if args.queues_only:
            figures = queue_figures(admin_dsn)
        elif args.wal_only:
            figures = wal_only(admin_dsn)
        else:
            figures = measure(admin_dsn, args)
    finally:
        if cluster is not None:
            cluster.stop()
        else:
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                for name in (f"pgqueue_bench_{key}" for key in KEYS):
                    admin.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(name)
                        )
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


SPREAD = """
INSERT INTO pgqueue_jobs (queue, task, args)
SELECT 'q' || (g %% %(queues)s), 'task_' || (g %% 20), jsonb_build_object('n', g)
FROM generate_series(1, %(n)s) g
"""


def queue_figures(admin_dsn: str) -> dict[str, Any]:
    """Claim time as the number of queues grows: 10,000 due jobs spread over 1, 10 or 100
    queues, claimed 10 at a time by a worker serving every queue (claim_jobs) and by one that
    lists all of them (claim_jobs_in_queues); each claim acked. Medians of 200 claims."""
    q = queries("public")
    figures: dict[str, Any] = {}
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        migrate(conn, "public")
        conn.execute(LIVE_WORKER, {"id": WORKER})
        print("claim of 10, median ms, by queue count (10,000 due jobs):")
        for count in (1, 10, 100):
            names = [f"q{i}" for i in range(count)]
            row: dict[str, float] = {}
            for label, statement, extra in (
                ("every queue", q.claim_jobs, {}),
                ("listed queues", q.claim_jobs_in_queues, {"queues": names}),
            ):
                conn.execute("DELETE FROM pgqueue_jobs")
                conn.execute(SPREAD, {"queues": count, "n": 10_000})
                conn.execute("VACUUM ANALYZE pgqueue_jobs")
                times = []
                for _ in range(200):
                    token = uuid.uuid4()
                    params = {"worker_id": WORKER, "limit": 10, "token": token, "tasks": None}
                    started = time.perf_counter()
                    ids = [r[0] for r in conn.execute(statement, {**params, **extra}).fetchall()]
                    times.append(ms_since(started))
                    conn.execute(
                        "UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now()"
                        " WHERE id = ANY(%s)",
                        [ids],
                    )
                row[label] = statistics.median(times)
            figures[str(count)] = row
            print(f"  {count:3} queues: every queue {row['every queue']:.2f}, "
                  f"listed {row['listed queues']:.2f}")  # fmt: skip
    return figures


def wal_only(admin_dsn: str) -> dict[str, Any]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        migrate(conn, "public")
        conn.execute(LIVE_WORKER, {"id": WORKER})
        q = queries("public")
        figures: dict[str, Any] = {"wal_bytes_per_job": wal_figures(conn, q)}
        # What retention adds: deleting a finished job, or moving it to the archive.
        conn.execute(q.archive_partitions, {"keep_seconds": None, "with_dead": False})
        for name, statement in (
            ("prune", q.prune_finished_jobs),
            ("archive", q.archive_finished_jobs),
        ):
            conn.execute("CHECKPOINT")
            start = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            cur = conn.execute(
                statement, {"older_than": 0.0, "batch": 20_000, "keep_seconds": None}
            )
            row = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start]
            ).fetchone()
            figures[f"wal_bytes_per_{name}"] = float(row[0]) / cur.rowcount  # type: ignore[index]
            print(f"WAL bytes per job {name}d (after a checkpoint): "
                  f"{figures[f'wal_bytes_per_{name}']:,.0f}")  # fmt: skip
        return figures


def measure(admin_dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    dsns = {}
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        for key in KEYS:
            ident = sql.Identifier(f"pgqueue_bench_{key}")
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
            admin.execute(sql.SQL("CREATE DATABASE {}").format(ident))
            dsns[key] = conninfo.make_conninfo(admin_dsn, dbname=f"pgqueue_bench_{key}")
    q = queries("public")
    conns = {key: psycopg.connect(dsn, autocommit=True) for key, dsn in dsns.items()}
    figures: dict[str, Any] = {"finished": args.finished, "delayed": args.delayed}
    for conn in conns.values():
        migrate(conn, "public")
        conn.execute(LIVE_WORKER, {"id": WORKER})
    full = conns["full"]
    started = time.monotonic()
    full.execute(FILL_FINISHED, {"n": args.finished})
    filled = time.monotonic() - started
    full.execute("VACUUM ANALYZE pgqueue_jobs")
    size = full.execute(SIZE).fetchone()
    assert size is not None
    per_million = {
        "table_mb": size[0] / 2**20 / (args.finished / 1e6),
        "indexes_mb": size[1] / 2**20 / (args.finished / 1e6),
        "total_mb": size[2] / 2**20 / (args.finished / 1e6),
    }
    figures["per_million_finished"] = per_million
    print(f"filled {args.finished:,} finished jobs in {filled:.0f} s; per million: "
          f"table {per_million['table_mb']:.0f} MB + indexes {per_million['indexes_mb']:.0f} MB"
          f" = {per_million['total_mb']:.0f} MB")  # fmt: skip
    full.execute(FILL_DELAYED, {"n": args.delayed})
    conns["delayed"].execute(FILL_DELAYED, {"n": args.delayed})
    for conn in conns.values():
        conn.execute("VACUUM ANALYZE")
    size = full.execute(SIZE).fetchone()
    assert size is not None
    print(f"full table with {args.delayed:,} delayed too: {size[2] / 2**20:,.0f} MB")
    figures["full_total_mb"] = size[2] / 2**20

    times: dict[str, list[float]] = {}
    for key in conns:
        for what in ("claim", "ack", "plain claim", "plain ack", "refresh"):
            times[f"{key} {what}"] = []
    panels: dict[str, dict[str, list[float]]] = {key: {} for key in conns}
    dashboards = {}
    for key, dsn in dsns.items():
        dashboards[key] = psycopg.connect(dsn, **session_options())
        dashboards[key].read_only = True
    for i in range(args.rounds):
        # Alternate, in a rotating order: all see the same moments of the machine, and none is
        # always the first after another's writes.
        order = list(conns)[i % len(conns) :] + list(conns)[: i % len(conns)]
        for key, conn in ((k, conns[k]) for k in order):
            round_of_work(conn, q, q.claim_jobs_by_priority, times, key)
            round_of_work(conn, q, q.claim_jobs, times, f"{key} plain")
            if i < args.refreshes:
                refresh = refresh_ms(conn, dashboards[key])
                # With a worker running the dashboard reads its fresh depth sample and does
                # not count (depth_count: only when no worker runs), as dashboard_queries.py.
                times[f"{key} refresh"].append(
                    sum(ms for name, ms in refresh.items() if name != "depth_count")
                )
                for name, ms in refresh.items():
                    panels[key].setdefault(name, []).append(ms)
    print(
        f"\nmedian ms over {args.rounds} rounds of 100 jobs (claims of 10, acks of 10); "
        "ratio: to the empty table"
    )
    print(f"{'':34} {'empty':>8} {'delayed':>8} {'ratio':>6} {'full':>8} {'ratio':>6}")
    medians: dict[str, Any] = {}
    for label, what in (
        ("claim (claim_jobs_by_priority)", "claim"),
        ("ack (complete_jobs)", "ack"),
        ("claim (claim_jobs)", "plain claim"),
        ("ack after claim_jobs", "plain ack"),
        ("dashboard refresh, DB time", "refresh"),  # with workers running
    ):
        m = {key: statistics.median(times[f"{key} {what}"]) for key in conns}
        medians[what] = {**m, "ratio_delayed": m["delayed"] / m["empty"],
                         "ratio_full": m["full"] / m["empty"]}  # fmt: skip
        print(f"{label:34} {m['empty']:8.2f} {m['delayed']:8.2f} "
              f"{m['delayed'] / m['empty']:6.2f} {m['full']:8.2f} {m['full'] / m['empty']:6.2f}")  # fmt: skip
    figures["medians_ms"] = medians
    by_panel = {
        name: {key: statistics.median(panels[key][name]) for key in conns}
        for name in panels["empty"]
    }
    figures["refresh_panels_ms"] = by_panel
    print("\ndashboard statements, median ms (the five slowest on the full table):")
    for name, m in sorted(by_panel.items(), key=lambda kv: -kv[1]["full"])[:5]:
        print(f"  {name:32} {m['empty']:8.2f} {m['delayed']:8.2f} {m['full']:8.2f}")

    # Vacuum after the same churn: what a day of history costs autovacuum each time it runs.
    vacuum = {}
    for key, conn in conns.items():
        if key == "delayed":
            continue
        sink: dict[str, list[float]] = {"v claim": [], "v ack": []}
        for _ in range(100):
            round_of_work(conn, q, q.claim_jobs, sink, "v")
        started = time.perf_counter()
        conn.execute("VACUUM pgqueue_jobs")
        vacuum[key] = ms_since(started)
    figures["vacuum_after_10000_jobs_ms"] = vacuum
    print(f"\nVACUUM pgqueue_jobs after 10,000 jobs: empty {vacuum['empty']:.0f} ms, "
          f"full {vacuum['full']:.0f} ms")  # fmt: skip

    started = time.perf_counter()
    cur = full.execute(q.prune_finished_jobs, {"older_than": 0.0, "batch": 10_000})
    batch_ms = ms_since(started)
    figures["prune_batch"] = {"rows": cur.rowcount, "ms": batch_ms}
    print(f"one prune batch on the full table: {cur.rowcount:,} rows in {batch_ms:.0f} ms")

    # The archive: move the oldest finished jobs in the worker's batches, and size them there.
    full.execute(q.archive_partitions, {"keep_seconds": None, "with_dead": False})
    batches: list[float] = []
    moved = 0
    while moved < args.archive_rows:
        started = time.perf_counter()
        cur = full.execute(
            q.archive_finished_jobs, {"older_than": 0.0, "batch": 10_000, "keep_seconds": None}
        )
        batches.append(ms_since(started))
        moved += cur.rowcount
    row = full.execute(ARCHIVE_SIZE).fetchone()
    assert row is not None
    archive = {
        "rows": moved,
        "batch_ms_median": statistics.median(batches),
        "rows_per_second": moved / (sum(batches) / 1000),
        "mb_per_million": float(row[0]) / 2**20 / (moved / 1e6),
    }
    figures["archive"] = archive
    print(f"archive: {moved:,} jobs moved in batches of 10,000, median {archive['batch_ms_median']:.0f}"
          f" ms a batch ({archive['rows_per_second']:,.0f} jobs/s); "
          f"{archive['mb_per_million']:.0f} MB per million archived (table + index)")  # fmt: skip

    figures["wal_bytes_per_job"] = wal_figures(conns["empty"], q)
    for conn in (*conns.values(), *dashboards.values()):
        conn.close()
    return figures


if __name__ == "__main__":
    main()
