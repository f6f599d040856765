"""Known jobs in, known numbers out: every panel's query against the real database."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pgqueue import stats
from pgqueue.dashboard import job_page, queries
from pgqueue.dashboard.database import Database
from tests.dashboard_data import WORKER_LATE, WORKER_OK, plant, planted_retries_in_the_minute_to


def _read(dsn: str) -> queries.Reading:
    async def go() -> queries.Reading:
        database = Database(dsn)
        try:
            async with database.session() as conn:
                return await queries.read(conn, "public", late_after=15.0)
        finally:
            await database.close()

    return asyncio.run(go())


def test_an_empty_database_reads_as_every_empty_state(dsn: str) -> None:
    r = _read(dsn)
    assert r.depth == {} and r.workers == [] and r.running == [] and r.problems == []
    assert r.feed == [] and r.schedules == []
    assert r.throughput["rate"] == 0 and sum(r.throughput["succeeded"]) == 0
    assert r.latency == {"pickup_p50": None, "pickup_p95": None, "run_p50": None, "run_p95": None}
    assert r.depth_samples == [] and r.problem_counts == {"dead": 0, "retrying": 0}


def test_planted_jobs_give_known_figures(dsn: str, conn: psycopg.Connection[Any]) -> None:
    plant(conn)
    r = _read(dsn)
    assert r.depth["emails"] == {"queued": 5, "retrying": 1, "running": 2}
    assert r.depth["reports"] == {"queued": 1, "retrying": 0, "running": 0}
    # 60 seconds of 10 succeeded + 1 retried, one dead: the window holds them all.
    assert sum(r.throughput["succeeded"]) == 600
    retries = planted_retries_in_the_minute_to(conn, r.second)
    assert r.throughput["retries_60s"] == retries and r.throughput["failed_60s"] == 1
    assert r.latency["pickup_p50"] == stats.bin_value(stats.bin_of(0.004))
    assert r.latency["run_p95"] == stats.bin_value(stats.bin_of(0.25))
    assert len({s[0] for s in r.depth_samples}) == 90

    workers = {w["id"]: w for w in r.workers}
    assert workers[str(WORKER_OK)]["leases"] == 2 and not workers[str(WORKER_OK)]["late"]
    assert workers[str(WORKER_LATE)]["leases"] == 0 and workers[str(WORKER_LATE)]["late"]

    assert [j["attempt"] for j in r.running] == [2, 1]  # longest running first
    assert all(0 < j["lease_left"] <= 25 for j in r.running)
    assert r.running[0]["args"] == '{"to": "c@example.com"}'

    assert [(p["status"], p["task"]) for p in r.problems] == [
        ("dead", "send_email"), ("retrying", "send_email")
    ]  # fmt: skip
    dead = r.problems[0]
    assert dead["error"].startswith("SMTPError") and len(dead["error"]) == 300
    assert dead["error_length"] > 300 and dead["when"] < 0
    assert r.problems[1]["when"] > 0  # retry due in the future
    assert r.problem_counts == {"dead": 1, "retrying": 1}

    events = {e["event"] for e in r.feed}
    assert {"enqueued", "started", "succeeded", "dead"} <= events
    assert [e["at"] for e in r.feed] == sorted((e["at"] for e in r.feed), reverse=True)
    assert len(r.feed) <= queries.FEED_LIMIT

    assert r.schedules is not None
    assert [s["name"] for s in r.schedules] == ["digest", "nightly-report"]
    assert r.schedules[0]["next_run"] > 0 and r.schedules[0]["last_run"] < 0
    assert r.inserts_total is not None  # statistics lag up to a second behind


def test_large_arguments_are_never_read_for_the_lists(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args, status, lease_token, lease_expires_at,"
        " claimed_at, attempts) VALUES ('q', 't', "
        " jsonb_build_object('blob', (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 3000) g)),"
        " 'running', gen_random_uuid(), now() + interval '30 s', now(), 1)"
    )
    (job,) = _read(dsn).running
    assert job["args"].startswith("… ") and job["args"].endswith(" bytes")


def test_finished_since_counts_only_settled_buckets_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_stats (bucket, worker_id, queue, succeeded, dead) VALUES"
        " (date_trunc('second', now()) - interval '10 s', gen_random_uuid(), 'a', 3, 1),"
        " (date_trunc('second', now()), gen_random_uuid(), 'a', 100, 0)"
    )

    async def go() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        database = Database(dsn)
        try:
            async with database.session() as c:
                until, first = await queries.finished_since(c, "public", None)
            async with database.session() as c:
                _, again = await queries.finished_since(c, "public", until)
            return first, again
        finally:
            await database.close()

    first, again = asyncio.run(go())
    assert [(r[0], r[1], r[3]) for r in first] == [("a", 3, 1)]  # the current second waits
    assert again == []


def test_a_deep_backlogs_older_sample_still_stands_for_the_current_depth(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('a', 't')")
    # A sample this deep holds for a minute: five seconds old, it still stands however long a
    # loaded machine takes to read (one holding for 4 s stood only within the second planted).
    old = 60 * stats.DEPTH_ROWS_PER_SECOND
    conn.execute(
        "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running)"
        " VALUES (date_trunc('second', now()) - interval '5 seconds', 'a', %s, 0, 0)",
        (old,),
    )
    assert _read(dsn).depth == {"a": {"queued": old, "retrying": 0, "running": 0}}
    # A shallow one holds for a second (plus two of slack): five seconds on, the dashboard counts.
    conn.execute("UPDATE pgqueue_depth SET queued = 7")
    assert _read(dsn).depth == {"a": {"queued": 1, "retrying": 0, "running": 0}}


def test_job_detail_has_the_full_error(dsn: str, conn: psycopg.Connection[Any]) -> None:
    plant(conn)
    row = conn.execute("SELECT id FROM pgqueue_jobs WHERE status = 'dead'").fetchone()
    assert row is not None

    async def go() -> job_page.JobPage | None:
        database = Database(dsn)
        try:
            async with database.session() as c:
                return await job_page.read(c, "public", int(row[0]))
        finally:
            await database.close()

    detail = asyncio.run(go())
    assert detail is not None and detail.row["last_error"].endswith("END-OF-TRACEBACK")
    assert detail.row["status"] == "dead" and detail.why is None


def test_current_depth_comes_from_a_fresh_worker_sample_else_from_a_count(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('a', 't'), ('a', 't')")
    assert _read(dsn).depth == {"a": {"queued": 2, "retrying": 0, "running": 0}}
    conn.execute(
        "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running)"
        " VALUES (date_trunc('second', now()), 'a', 40, 1, 3)"
    )
    # Waiting counts come from the sample; running ones are always counted live (none here).
    assert _read(dsn).depth == {"a": {"queued": 40, "retrying": 1, "running": 0}}
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, lease_token, lease_expires_at, claimed_at)"
        " VALUES ('b', 't', 'running', gen_random_uuid(), now() + interval '30 s', now())"
    )
    assert _read(dsn).depth == {
        "a": {"queued": 40, "retrying": 1, "running": 0},
        "b": {"queued": 0, "retrying": 0, "running": 1},
    }
