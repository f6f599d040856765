"""Workers write the dashboard's per-second aggregates as they ack."""

from __future__ import annotations

from typing import Any

import psycopg

import pgqueue
from tests.helpers import running_worker, wait_until_async


async def test_worker_writes_per_second_outcome_counts(
    app: pgqueue.App, conn: psycopg.Connection[tuple[Any, ...]]
) -> None:
    @app.task(queue="statsq", max_attempts=1)
    async def maybe(fail: bool) -> None:
        if fail:
            raise RuntimeError("no")

    app.enqueue_many([("maybe", {"fail": False})] * 5 + [("maybe", {"fail": True})] * 2)

    def totals() -> tuple[int, ...] | None:
        return conn.execute(
            "SELECT coalesce(sum(succeeded), 0)::int, coalesce(sum(dead), 0)::int,"
            " coalesce(sum(lost), 0)::int FROM pgqueue_stats WHERE queue = 'statsq'"
        ).fetchone()

    async with running_worker(app, poll_interval=0.2):
        await wait_until_async(lambda: totals() == (5, 2, 0), timeout=15)
