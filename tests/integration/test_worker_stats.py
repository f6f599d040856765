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

    def totals() -> dict[str, int]:
        row = conn.execute("SELECT * FROM pgqueue_stats WHERE queue = 'statsq' LIMIT 0").description
        assert row is not None
        cols = [c.name for c in row]
        wanted = [c for c in ("succeeded", "dead") if c in cols]
        values = conn.execute(
            "SELECT "
            + ", ".join(f"coalesce(sum({c}), 0)" for c in wanted)
            + " FROM pgqueue_stats WHERE queue = 'statsq'"
        ).fetchone()
        assert values is not None
        return dict(zip(wanted, (int(v) for v in values), strict=True))

    async with running_worker(app, poll_interval=0.2):
        await wait_until_async(lambda: totals() == {"succeeded": 5, "dead": 2}, timeout=15)
