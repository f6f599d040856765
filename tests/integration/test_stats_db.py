"""flush, sample_depth and prune_stats against the real database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from pgqueue import stats


async def _connect(dsn: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


def test_flush_writes_one_row_per_queue_in_one_statement_and_then_nothing(dsn: str) -> None:
    worker = uuid.uuid4()

    async def scenario() -> list[tuple[Any, ...]]:
        recorder = stats.StatsRecorder("public", worker)
        for _ in range(3):
            recorder.record("a", "succeeded", 0.002, 0.05)
        recorder.record("b", "dead", 0.3, 1.5)
        async with await _connect(dsn) as conn:
            await recorder.flush(conn)
            await recorder.flush(conn)  # nothing new: no second row
            cur = await conn.execute(
                "SELECT queue, succeeded, retried, dead, lost, pickup_hist, run_hist,"
                " bucket = date_trunc('second', bucket), worker_id"
                " FROM pgqueue_stats ORDER BY queue"
            )
            return await cur.fetchall()

    rows = asyncio.run(scenario())
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [("a", 3, 0, 0, 0), ("b", 0, 0, 1, 0)]
    assert rows[0][5] == {str(stats.bin_of(0.002)): 3}
    assert rows[1][6] == {str(stats.bin_of(1.5)): 1}
    assert all(r[7] for r in rows) and all(r[8] == worker for r in rows)


def test_a_failed_flush_keeps_the_counts_for_the_next_one(dsn: str) -> None:
    async def scenario() -> int:
        recorder = stats.StatsRecorder("public", uuid.uuid4())
        recorder.record("a", "succeeded", 0.01, 0.01)
        async with await _connect(dsn) as conn:
            await conn.execute("ALTER TABLE pgqueue_stats RENAME TO pgqueue_stats_away")
            with pytest.raises(psycopg.errors.UndefinedTable):
                await recorder.flush(conn)
            recorder.record("a", "succeeded", 0.01, 0.01)
            await conn.execute("ALTER TABLE pgqueue_stats_away RENAME TO pgqueue_stats")
            await recorder.flush(conn)
            cur = await conn.execute("SELECT sum(succeeded)::int FROM pgqueue_stats")
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

    assert asyncio.run(scenario()) == 2


def test_sample_depth_writes_each_queue_once_per_second_across_workers(dsn: str) -> None:
    async def scenario() -> list[tuple[Any, ...]]:
        async with await _connect(dsn) as conn:
            await conn.execute(
                "INSERT INTO pgqueue_jobs (queue, task, status) VALUES"
                " ('a','t','queued'), ('a','t','queued'), ('a','t','retrying'),"
                " ('b','t','running'), ('b','t','succeeded')"
            )
            async with conn.transaction():
                # One transaction: both "workers" see the same now(), i.e. the same second.
                await stats.sample_depth(conn, "public")
                await stats.sample_depth(conn, "public")
            cur = await conn.execute(
                "SELECT queue, queued, retrying, running FROM pgqueue_depth ORDER BY queue"
            )
            return await cur.fetchall()

    assert asyncio.run(scenario()) == [("a", 2, 1, 0), ("b", 0, 0, 1)]


def test_a_deep_backlogs_sample_holds_for_longer_before_anyone_counts_again(dsn: str) -> None:
    """With 2 jobs per second of holding, a sample that saw 10 waiting holds for 5 seconds."""

    async def sampled_after(age: int) -> list[tuple[Any, ...]]:
        async with await _connect(dsn) as conn, conn.transaction():
            await conn.execute("DELETE FROM pgqueue_depth")
            await conn.execute(
                "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running) VALUES"
                " (date_trunc('second', now()) - make_interval(secs => %s), 'a', 8, 2, 0)",
                (age,),
            )
            await stats.sample_depth(conn, "public", rows_per_second=2)
            cur = await conn.execute(
                "SELECT queue, queued FROM pgqueue_depth WHERE bucket = date_trunc('second', now())"
            )
            return await cur.fetchall()

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgqueue_jobs (queue, task) SELECT 'a', 't' FROM generate_series(1, 3)"
        )
    assert asyncio.run(sampled_after(4)) == []  # still holds: nobody counts
    assert asyncio.run(sampled_after(5)) == [("a", 3)]
    assert stats.depth_holds(10, 2) == 5 and stats.depth_holds(1, 2) == 1


def test_prune_stats_drops_rows_older_than_the_window(dsn: str) -> None:
    async def scenario() -> tuple[int, int]:
        async with await _connect(dsn) as conn:
            await conn.execute(
                "INSERT INTO pgqueue_stats (bucket, worker_id, queue, succeeded) VALUES"
                " (now() - interval '2 hours', gen_random_uuid(), 'a', 1),"
                " (now(), gen_random_uuid(), 'a', 1)"
            )
            await conn.execute(
                "INSERT INTO pgqueue_depth (bucket, queue, queued, retrying, running) VALUES"
                " (now() - interval '2 hours', 'a', 1, 0, 0), (now(), 'a', 1, 0, 0)"
            )
            await stats.prune_stats(conn, "public", older_than_seconds=3600)
            s = await (await conn.execute("SELECT count(*) FROM pgqueue_stats")).fetchone()
            d = await (await conn.execute("SELECT count(*) FROM pgqueue_depth")).fetchone()
            assert s is not None and d is not None
            return int(s[0]), int(d[0])

    assert asyncio.run(scenario()) == (1, 1)
