"""The dashboard against a hot standby: a real primary and a standby streaming from it
(tests/replication.py), jobs written on the primary, every panel and a job's page read through
the standby, with its lag shown. Nothing the dashboard does may fail there: a standby refuses
every write, so a stray one would show up as an error."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg
import pytest
from psycopg import conninfo
from starlette.testclient import TestClient

import pgqueue
from pgqueue.dashboard.app import create_app
from pgqueue.dashboard.database import writable_tables
from pgqueue.dashboard.refresh import Refresher
from tests.dashboard_data import plant
from tests.helpers import wait_until
from tests.replication import Replicated

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

ROLE = "pgqueue_dashboard"
#: docs/dashboard.md's SELECT-only role, as a production dashboard would connect.
ROLE_SQL = [
    f"CREATE ROLE {ROLE} LOGIN",
    f"GRANT USAGE ON SCHEMA public TO {ROLE}",
    "GRANT SELECT ON pgqueue_jobs, pgqueue_workers, pgqueue_schedules, pgqueue_stats,"
    " pgqueue_depth, pgqueue_queues, pgqueue_job_deps, pgqueue_tasks, pgqueue_rates,"
    f" pgqueue_job_waits, pgqueue_attempts TO {ROLE}",
    f"ALTER ROLE {ROLE} SET default_transaction_read_only = on",
]
#: Snapshot figures that depend on rows only, not on the instant they are read.
SAME = ("paused_queues", "problem_counts")
#: The Queues now table's fields that are ages or rates: read at two instants, they differ.
MOVING = ("oldest", "rate")


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in MOVING} for row in rows]


def snapshot(client: TestClient, after: int = 0) -> dict[str, Any]:
    def fresh() -> dict[str, Any] | None:
        response = client.get("/api/snapshot")
        body: dict[str, Any] | None = response.json() if response.status_code == 200 else None
        return body if body and body["status"] == "ok" and body["refresh"] > after else None

    found: dict[str, Any] = wait_until(fresh, timeout=30, what="a fresh snapshot")
    return found


def ids(rows: list[dict[str, Any]], key: str = "id") -> list[Any]:
    return sorted(row[key] for row in rows)


@pytest.mark.timeout(180)
def test_the_dashboard_reads_a_hot_standby(replicated: Replicated) -> None:
    primary, standby = replicated.primary, replicated.standby
    app = pgqueue.App(primary.dsn)
    try:
        app.migrate()
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            plant(conn)
            for statement in ROLE_SQL:
                conn.execute(statement)
        for n in range(4):
            app.enqueue("greet", {"name": f"u{n}"}, queue="greetings", allow_unknown=True)
        replicated.wait_replayed()

        on_primary = create_app(conninfo.make_conninfo(primary.dsn, user=ROLE))
        on_standby = create_app(
            conninfo.make_conninfo(standby.dsn, user=ROLE), refresh_interval=0.2
        )
        with (
            TestClient(on_primary, base_url="http://127.0.0.1") as p,
            TestClient(on_standby, base_url="http://127.0.0.1") as s,
        ):
            mine, theirs = snapshot(p), snapshot(s)
            assert mine["replica"] is None
            assert theirs["replica"] is not None and theirs["replica"]["streaming"] is True
            lag = theirs["replica"]["lag"]
            assert lag is not None and 0 <= lag < 30
            assert theirs["writable"] == []
            for key in SAME:
                assert theirs[key] == mine[key], key
            assert steady(theirs["queues"]) == steady(mine["queues"])
            for a, b in zip(theirs["queues"], mine["queues"], strict=True):
                assert (a["oldest"] is None) == (b["oldest"] is None)
                assert a["oldest"] is None or abs(a["oldest"] - b["oldest"]) < 10
            for key in ("queued", "retrying", "running", "waiting"):
                assert theirs["tiles"][key] == mine["tiles"][key], key
            assert theirs["tiles"]["waiting"] == 11  # 7 planted, 4 enqueued
            assert ids(theirs["workers"]) == ids(mine["workers"])
            assert ids(theirs["running"]) == ids(mine["running"]) and theirs["running"]
            assert ids(theirs["problems"]) == ids(mine["problems"]) and theirs["problems"]
            assert ids(theirs["schedules"], "name") == ids(mine["schedules"], "name")
            assert ids(theirs["feed"]) == ids(mine["feed"])
            # A standby's table statistics count its own activity: no insert rate from them.
            assert theirs["rates"]["insert"] is None

            dead = next(row for row in theirs["problems"] if row["status"] == "dead")
            for job_id in (dead["id"], theirs["running"][0]["id"]):
                page = s.get(f"/jobs/{job_id}")
                assert page.status_code == 200 and "send_email" in page.text
                api, expected = (
                    s.get(f"/api/jobs/{job_id}").json(),
                    p.get(f"/api/jobs/{job_id}").json(),
                )
                for field in ("id", "task", "queue", "status", "attempts", "args", "last_error",
                              "created_at", "finished_at", "worker", "parents", "children"):  # fmt: skip
                    assert api[field] == expected[field], field
            assert "conn-replica" in s.get("/").text
            assert "pgqueue_dashboard_replica_lag_seconds" in s.get("/metrics").text
            assert "pgqueue_dashboard_replica_lag_seconds" not in p.get("/metrics").text
            assert s.get("/readyz").text == "ok"

            # More writes on the primary while the standby's replay is paused: they arrive but
            # are not applied, so the dashboard shows the lag growing from the last commit
            # replayed, and the figures as of then. Resumed, it catches up.
            with psycopg.connect(standby.dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_wal_replay_pause()")
                for n in range(3):
                    app.enqueue(
                        "greet", {"name": f"later{n}"}, queue="greetings", allow_unknown=True
                    )

                def behind() -> dict[str, Any] | None:
                    snap = snapshot(s)
                    lag = snap["replica"]["lag"]
                    return snap if lag is not None and lag >= 1 else None

                paused = wait_until(behind, timeout=30, what="a lag of a second or more")
                assert paused["tiles"]["waiting"] == 11
                assert re.search(
                    r"pgqueue_dashboard_replica_lag_seconds [1-9]", s.get("/metrics").text
                )
                admin.execute("SELECT pg_wal_replay_resume()")
            replicated.wait_replayed()

            def caught_up() -> dict[str, Any] | None:
                # The next refresh may have begun before the replay it must show (a loaded
                # machine): wait for the figures, not for one more refresh.
                snap = snapshot(s)
                return snap if snap["tiles"]["waiting"] == 14 else None

            later = wait_until(caught_up, timeout=30, what="the standby's figures caught up")
            assert later["replica"]["lag"] is not None and later["replica"]["lag"] < 30
            refresher: Refresher = on_standby.state.refresher
            assert refresher.failures == 0

            # Promoted (the fixture's failover step), the standby is a primary: the same
            # dashboard, on the same connection, stops saying replica.
            standby.promote()
            wait_until(
                lambda: snapshot(s)["replica"] is None, timeout=30, what="no longer a replica"
            )
            assert refresher.failures == 0
    finally:
        app.close()

    # The role-can-write check reads the catalogs only: on the standby it answers, and still
    # reports a superuser (roles are the primary's, and a promoted standby would obey them).
    async def superuser_check() -> list[str]:
        async with await psycopg.AsyncConnection.connect(standby.dsn, autocommit=True) as conn:
            return await writable_tables(conn, "public")

    assert asyncio.run(superuser_check()) == ["*"]
    # Nothing the dashboard ran was refused (a write, SERIALIZABLE, a lock a standby cannot take).
    assert "ERROR" not in standby.server_log(), standby.server_log()
