"""A claim by turn against the per-key claim as shipped: a prototype measured, not built.

    .venv/bin/python -m benchmarks.claim_by_turn [--dsn postgresql://...] [--rounds 3]
        [--claims 10]

30,000 no-op jobs of ``pgqueue bench``'s keyed task (``limit=1`` per key over 1,000 keys) wait
in a fresh database (on the server of ``--dsn``; without it, a throwaway server); before each
claim, 500 of the 1,000 groups hold their slot (one job of each running), as in a drain. Then,
timed from the client, one claim of 250 jobs three ways:

- **walk**: the limited claim as the fetcher makes it (``lock_limit_groups``, then
  ``claim_limited_jobs``, one transaction), walking 600 groups from a random cursor;
- **turn**: the prototype. Every waiting job gets its turn (its place in its group's line) and
  an index ``(turn, priority DESC, run_at, id)``; one scan of it, behind one advisory lock for
  the task, takes every free group's first job before any group's second;
- **plain**: the claim of 250 jobs without limits (``claim_jobs``' row work, no group rules),
  for scale.

The turns are filled in by hand on this scratch database: nothing in pgqueue assigns them
(docs/performance.md, "Two ways forward for the per-key claim"). Medians of each variant's
claims per round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from typing import Any

import psycopg

import pgqueue
from pgqueue.bench.adapter import KEYED_TASK, declare_keyed
from pgqueue.bench.processes import Databases
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.sql import queries
from pgqueue.worker.fetcher import LIMIT_CLAIM_IDLE_MS
from tests.helpers import limited_claim_params, limited_walk_params

JOBS = 30_000
FILL = 5_000
HELD = 500
WANT = 250
WALKED = 600

TURN_CLAIM = """
WITH held AS (
    SELECT COALESCE(jsonb_object_agg(task || ':' || limit_key, n), '{}') AS n
    FROM (SELECT task, limit_key, count(*) AS n FROM pgqueue_jobs
          WHERE status = 'running' AND limit_key IS NOT NULL GROUP BY 1, 2) h
),
cand AS (
    SELECT j.id, j.task, j.limit_key, j.turn, j.priority, j.run_at FROM pgqueue_jobs j
    WHERE j.status IN ('queued', 'retrying') AND j.limit_key IS NOT NULL AND j.run_at <= now()
      AND NOT ((SELECT n FROM held) ? (j.task || ':' || j.limit_key))
    ORDER BY j.turn, j.priority DESC, j.run_at, j.id
    LIMIT %(scan)s
),
taken AS (
    SELECT id FROM (
        SELECT c.*, row_number() OVER (PARTITION BY task, limit_key
                                       ORDER BY turn, priority DESC, run_at, id) AS place
        FROM cand c) x
    WHERE place = 1 ORDER BY turn, priority DESC, run_at, id LIMIT %(limit)s
)
UPDATE pgqueue_jobs j
SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
    worker_id = %(worker_id)s, claimed_at = statement_timestamp()
WHERE j.id = ANY(ARRAY(SELECT id FROM taken))
RETURNING j.id, j.queue, j.task, j.limit_key, j.args::text
"""

PLAIN_CLAIM = """
UPDATE pgqueue_jobs j
SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
    worker_id = %(worker_id)s, claimed_at = statement_timestamp()
WHERE j.id = ANY(ARRAY(
    SELECT id FROM pgqueue_jobs WHERE status IN ('queued', 'retrying') AND run_at <= now()
    ORDER BY priority DESC, run_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
RETURNING j.id, j.queue, j.task, j.limit_key, j.args::text
"""


def _prepare(database: str) -> uuid.UUID:
    """The jobs, the task's limit, the turns and their index, a worker: the worker's id."""
    app = pgqueue.App(database)

    async def noop(seq: int) -> None: ...

    declare_keyed(app, noop)
    try:
        app.migrate()
        for start in range(0, JOBS, FILL):
            app.enqueue_many([(KEYED_TASK, {"seq": n}) for n in range(start, start + FILL)])
    finally:
        app.close()
    q = queries("public")
    worker = uuid.uuid4()
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            q.declare_task_limits,
            {"names": [KEYED_TASK], "limits": [1], "rate_limits": [None],
             "rate_periods": [None], "per_keys": [True]},
        )  # fmt: skip
        conn.execute("ALTER TABLE pgqueue_jobs ADD COLUMN turn int")
        conn.execute(
            "UPDATE pgqueue_jobs SET turn = t.n FROM (SELECT id, row_number() OVER"
            " (PARTITION BY task, limit_key ORDER BY id) AS n FROM pgqueue_jobs) t"
            " WHERE t.id = pgqueue_jobs.id"
        )
        conn.execute(
            "CREATE INDEX pgqueue_jobs_turn_idx ON pgqueue_jobs"
            " (turn, priority DESC, run_at, id) INCLUDE (task, limit_key)"
            " WHERE status IN ('queued', 'retrying') AND limit_key IS NOT NULL"
        )
        conn.execute(
            q.register_worker,
            {"worker_id": worker, "host": "bench", "pid": 1, "queues": None,
             "concurrency": 100, "lease": 3600.0, "tasks": None},
        )  # fmt: skip
        conn.execute("CREATE TABLE bench_start AS SELECT id, status, attempts FROM pgqueue_jobs")
        conn.execute("VACUUM ANALYZE pgqueue_jobs")
    return worker


def _reset(conn: psycopg.Connection[Any]) -> None:
    """Every job back as it was, then HELD groups with a running job."""
    conn.execute(
        "UPDATE pgqueue_jobs j SET status = s.status, attempts = s.attempts, lease_token = NULL,"
        " worker_id = NULL FROM bench_start s WHERE s.id = j.id AND j.status <> s.status"
    )
    conn.execute(
        "UPDATE pgqueue_jobs SET status = 'running' WHERE id IN (SELECT min(id) FROM pgqueue_jobs"
        " WHERE status = 'queued' GROUP BY limit_key ORDER BY random() LIMIT %s)",
        (HELD,),
    )


def _claim(conn: psycopg.Connection[Any], variant: str, worker: uuid.UUID) -> int:
    q = queries("public")
    token = uuid.uuid4()
    conn.execute("BEGIN")
    if variant == "walk":
        conn.execute(q.begin_limited_claim)
        conn.execute(q.limit_claim_settings, {"idle": LIMIT_CLAIM_IDLE_MS})
        walk = {
            **limited_walk_params([KEYED_TASK], WALKED),
            "after_key": str(random.randrange(1000)),
        }
        locks = conn.execute(q.lock_limit_groups, walk).fetchall()
        params = limited_claim_params(worker, [KEYED_TASK], locks, WANT)
        rows = conn.execute(q.claim_limited_jobs, params).fetchall()
    elif variant == "turn":
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('pgqueue bench: keyed task'))")
        params = {"scan": 3 * (HELD + WANT), "limit": WANT, "token": token, "worker_id": worker}
        rows = conn.execute(TURN_CLAIM, params).fetchall()
    else:
        params = {"limit": WANT, "token": token, "worker_id": worker}
        rows = conn.execute(PLAIN_CLAIM, params).fetchall()
    conn.execute("COMMIT")
    return len(rows)


def bench(dsn: str, rounds: int, claims: int) -> None:
    variants = ["walk", "turn", "plain"]
    results: dict[str, list[float]] = {v: [] for v in variants}
    with Databases(dsn).fresh() as database:
        worker = _prepare(database)
        with psycopg.connect(database, autocommit=True) as conn:
            for index in range(rounds):
                for variant in variants[index % 3 :] + variants[: index % 3]:
                    took, got = [], []
                    for _ in range(claims):
                        _reset(conn)
                        began = time.perf_counter()
                        got.append(_claim(conn, variant, worker))
                        took.append(time.perf_counter() - began)
                    _reset(conn)
                    conn.execute("VACUUM pgqueue_jobs")
                    ms = statistics.median(took) * 1e3
                    results[variant].append(ms)
                    print(
                        f"round {index + 1}  {variant:<6}{ms:7.2f} ms a claim"
                        f"  ({statistics.median(got):.0f} jobs)",
                        flush=True,
                    )
    print("\nmedians of the rounds:")
    plain = statistics.median(results["plain"])
    for variant in variants:
        ms = statistics.median(results[variant])
        print(f"{variant:<6}{ms:7.2f} ms a claim of {WANT}  ({ms / plain:.2f}x the plain claim)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a server where databases may be created")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--claims", type=int, default=10, help="claims per variant and round")
    options = parser.parse_args()
    if options.dsn:
        bench(options.dsn, options.rounds, options.claims)
        return
    with EmbeddedPostgres() as server:
        bench(server.dsn, options.rounds, options.claims)


if __name__ == "__main__":
    main()
