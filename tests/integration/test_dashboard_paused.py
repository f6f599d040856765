"""The dashboard reads which queues are paused, in the same read-only refresh as every panel."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pgqueue.dashboard import queries
from pgqueue.dashboard.database import Database
from pgqueue.dashboard.refresh import Refresher
from tests.dashboard_data import plant


def _read(dsn: str) -> queries.Reading:
    async def go() -> queries.Reading:
        database = Database(dsn)
        try:
            async with database.session() as conn:
                return await queries.read(conn, "public", late_after=15.0)
        finally:
            await database.close()

    return asyncio.run(go())


def test_paused_queues_reach_the_snapshot_the_page_polls(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    assert _read(dsn).paused == []
    conn.execute(
        "INSERT INTO pgqueue_queues (name, paused) VALUES ('reports', true), ('emails', false),"
        " ('no-jobs', true)"
    )  # 'emails' was paused once and resumed: its row stays, unpaused
    assert _read(dsn).paused == ["no-jobs", "reports"]

    async def snapshot() -> dict[str, Any]:
        database = Database(dsn)
        try:
            return await Refresher(database, "public").refresh_once()
        finally:
            await database.close()

    snap = asyncio.run(snapshot())
    assert snap["paused_queues"] == ["no-jobs", "reports"]
    # The queues table names a queue with an operator's setting even with no jobs.
    assert {q["queue"]: q["paused"] for q in snap["queues"]} == {
        "emails": False, "reports": True, "no-jobs": True,
    }  # fmt: skip
