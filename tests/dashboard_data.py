"""Known rows for the dashboard tests: every panel gets something to show.

Times are relative to the database clock so figures are predictable whatever the host's clock.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from pgqueue import stats

WORKER_OK = uuid.UUID("11111111-1111-4111-8111-111111111111")
WORKER_LATE = uuid.UUID("22222222-2222-4222-8222-222222222222")
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=1</script>'


def plant(conn: psycopg.Connection[Any], *, xss: bool = False) -> None:
    """Jobs in every state, two workers (one late), a minute of stats and depth, schedules."""
    evil = XSS if xss else ""
    conn.execute(
        "INSERT INTO pgqueue_workers (id, host, pid, queues, concurrency, last_heartbeat_at)"
        " VALUES (%s, 'web-1', 101, NULL, 8, now() - interval '1 second'),"
        " (%s, 'web-2', 202, ARRAY['emails'], 4, now() - interval '40 seconds')",
        (WORKER_OK, WORKER_LATE),
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status) "
        "SELECT 'emails', 'send_email', jsonb_build_object('to', 'a' || g || '@example.com'),"
        " 'queued' FROM generate_series(1, 5) g"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status) VALUES"
        " ('reports' || %(e)s, 'build_report' || %(e)s, %(args)s, 'queued')",
        {"e": evil, "args": json.dumps({"note": evil or "monthly"})},
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, lease_token,"
        " lease_expires_at, worker_id, claimed_at) VALUES"
        " ('emails', 'send_email', '{\"to\": \"b@example.com\"}', 'running', 1,"
        "  gen_random_uuid(), now() + interval '25 seconds', %(w)s, now() - interval '3 seconds'),"
        " ('emails', 'send_email', '{\"to\": \"c@example.com\"}', 'running', 2,"
        "  gen_random_uuid(), now() + interval '12 seconds', %(w)s, now() - interval '8 seconds')",
        {"w": WORKER_OK},
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, max_attempts, last_error,"
        " finished_at) VALUES ('emails', 'send_email', '{}', 'dead', 5, 5,"
        " %(err)s, now() - interval '30 seconds')",
        {"err": "SMTPError: mailbox unavailable" + evil + "\nTraceback (most recent call last):\n"
         + "  File \"tasks.py\", line 12, in send_email\n" * 40 + "END-OF-TRACEBACK"},
    )  # fmt: skip
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status, attempts, last_error, run_at)"
        " VALUES ('emails', 'send_email', '{}', 'retrying', 2, 'TimeoutError: took too long',"
        " now() + interval '20 seconds')"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, attempts, claimed_at, finished_at)"
        " SELECT 'emails', 'send_email', 'succeeded', 1, now() - interval '2 seconds',"
        " now() - interval '1 second' FROM generate_series(1, 3)"
    )
    # Depth samples stop 3 s ago, so they are history and never the "current" sample.
    # 60 seconds of stats: 10 succeeded + 1 retried per second; one dead 5 s ago.
    pickup = {str(stats.bin_of(0.004)): 10}
    run = {str(stats.bin_of(0.25)): 10}
    conn.execute(
        "INSERT INTO pgqueue_stats (bucket, worker_id, queue, succeeded, retried, dead,"
        " pickup_hist, run_hist)"
        " SELECT date_trunc('second', now()) - make_interval(secs => g), %s, 'emails', 10, 1,"
        " CASE WHEN g = 5 THEN 1 ELSE 0 END, %s, %s FROM generate_series(1, 60) g",
        (WORKER_OK, json.dumps(pickup), json.dumps(run)),
    )
    conn.execute(
        "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running)"
        " SELECT date_trunc('second', now()) - make_interval(secs => g), 'emails', 20 + g % 7,"
        " 1, 2 FROM generate_series(3, 92) g"
    )
    conn.execute(
        "INSERT INTO pgqueue_schedules (name, cron, task, queue, next_run_at, last_run_at)"
        " VALUES ('nightly-report' || %(e)s, '0 3 * * *', 'build_report', 'reports',"
        " now() + interval '5 hours', now() - interval '19 hours'),"
        " ('digest', '*/15 * * * *', 'send_digest', 'emails', now() + interval '7 minutes',"
        " now() - interval '8 minutes')",
        {"e": evil},
    )


def planted_retries_in_the_minute_to(conn: psycopg.Connection[Any], end: int) -> int:
    """Retries the planted statistics hold in the retry tile's window: the 60 seconds up to
    ``end``, a reading's own second. 59 when read in the second of planting; a loaded machine
    that reads a second or two later sees fewer, and that is right (the window moved on)."""
    row = conn.execute(
        "SELECT coalesce(sum(retried), 0)::int FROM pgqueue_stats"
        " WHERE extract(epoch FROM bucket)::bigint BETWEEN %s AND %s",
        (end - 59, end),
    ).fetchone()
    assert row is not None and row[0] > 0, "the reading came more than a minute after planting"
    return int(row[0])
