"""The snapshot's queues table and health strip, read from a real database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import conninfo, sql

from pgqueue.dashboard import queries
from pgqueue.dashboard.cli import dashboard_command
from pgqueue.dashboard.database import Database
from pgqueue.dashboard.refresh import Refresher
from tests.dashboard_data import WORKER_OK, plant
from tests.helpers import wait_until


def _snapshot(dsn: str, **options: Any) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        database = Database(dsn)
        try:
            return await Refresher(database, "public", **options).refresh_once()
        finally:
            await database.close()

    return asyncio.run(go())


def _by_queue(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["queue"]: row for row in snap["queues"]}


def test_the_queues_table_has_counts_rates_ages_workers_and_settings(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    plant(conn)
    conn.execute(
        "INSERT INTO pgqueue_queues (name, paused, concurrency_limit, rate_limit, rate_period)"
        " VALUES ('reports', true, NULL, NULL, NULL), ('emails', false, 10, 100, 60),"
        " ('idle', false, 3, NULL, NULL)"
    )
    conn.execute(
        "INSERT INTO pgqueue_rates (name, period, times, counts)"
        " VALUES ('q:emails', 60, ARRAY[now() - interval '5 seconds'], ARRAY[7])"
    )
    conn.execute("UPDATE pgqueue_jobs SET run_at = now() - interval '90 seconds'"
                 " WHERE queue = 'emails' AND status = 'queued'")  # fmt: skip
    snap = _snapshot(dsn)
    rows = _by_queue(snap)
    assert sorted(rows) == ["emails", "idle", "reports"]
    emails = rows["emails"]
    assert (emails["queued"], emails["retrying"], emails["running"], emails["dead"]) == (5, 1, 2, 1)
    # 11 finished attempts a second were planted (10 succeeded, 1 retried; one dead more).
    assert 10.0 <= emails["rate"] <= 11.1
    assert emails["pickup_p95"] == pytest.approx(0.004, rel=0.1)
    assert 90 <= emails["oldest"] < 200
    assert emails["workers"] == [str(WORKER_OK)]  # web-2 serves emails but is late
    assert (emails["limit"], emails["rate_limit"], emails["rate_period"]) == (10, 100, 60)
    assert emails["rate_used"] == 7 and emails["paused"] is False
    assert emails["why"] is None  # its jobs run
    reports = rows["reports"]
    assert reports["paused"] is True and reports["queued"] == 1 and reports["dead"] == 0
    assert reports["why"]["code"] == "paused"
    idle = rows["idle"]  # a setting and nothing else
    assert (idle["queued"], idle["limit"], idle["oldest"], idle["why"]) == (0, 3, None, None)


def test_a_queue_says_why_its_waiting_jobs_do_not_run(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, run_at) VALUES ('orphan', 't', now()),"
        " ('later', 't', now() + interval '3 minutes'), ('capped', 't', now())"
    )
    conn.execute("INSERT INTO pgqueue_queues (name, concurrency_limit) VALUES ('capped', 0)")
    rows = _by_queue(_snapshot(dsn))
    assert {q: r["why"]["code"] for q, r in rows.items()} == {
        "orphan": "no_worker", "later": "no_worker", "capped": "no_worker",
    }  # fmt: skip
    conn.execute(
        "INSERT INTO pgqueue_workers (id, host, pid, queues, concurrency, lease_expires_at)"
        " VALUES (gen_random_uuid(), 'h', 1, ARRAY['later', 'capped', 'other'], 4,"
        " now() + interval '30 seconds')"
    )
    rows = _by_queue(_snapshot(dsn))
    why = {q: r["why"] for q, r in rows.items()}
    assert why["orphan"]["code"] == "no_worker_for_queue"
    assert "capped, later, other" in why["orphan"]["text"]
    assert why["later"]["code"] == "not_due"
    assert "due later: the next in 2m 5" in why["later"]["text"]
    assert rows["later"]["oldest"] < -170
    assert why["capped"]["code"] == "queue_limit"
    assert "limit of 0" in why["capped"]["text"]


def test_a_queue_whose_next_jobs_no_serving_worker_has(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, run_at, priority) VALUES"
        " ('mail', 'report', now(), 0), ('mail', 'digest', now(), 5),"
        " ('mail', 'send', now() + interval '1 hour', 0)"
    )
    conn.execute(
        "INSERT INTO pgqueue_workers (id, host, pid, queues, concurrency, lease_expires_at, tasks)"
        " VALUES (gen_random_uuid(), 'h', 1, ARRAY['mail'], 4, now() + interval '30 seconds',"
        " ARRAY['send'])"
    )
    why = _by_queue(_snapshot(dsn))["mail"]["why"]
    # The due heads of each priority are named; the task of a job not yet due is not.
    assert why["code"] == "unknown_task"
    assert "('digest', 'report')" in why["text"]
    assert _by_queue(_snapshot(dsn))["mail"]["workers"]
    # A serving worker that has one of them would run that one: not the reason then.
    conn.execute("UPDATE pgqueue_workers SET tasks = ARRAY['send', 'digest']")
    assert _by_queue(_snapshot(dsn))["mail"]["why"]["code"] == "ready"
    conn.execute("UPDATE pgqueue_workers SET tasks = NULL")
    assert _by_queue(_snapshot(dsn))["mail"]["why"]["code"] == "ready"


def test_an_open_transaction_holding_a_snapshot_is_named_then_goes(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    assert _snapshot(dsn, long_transaction=0.2)["health"]["transaction"] is None
    with psycopg.connect(dsn, autocommit=True, application_name="forgotten-psql") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        pid = holder.info.backend_pid

        def named() -> dict[str, Any] | None:
            found: dict[str, Any] | None = _snapshot(dsn, long_transaction=0.2)["health"][
                "transaction"
            ]
            return found if found is not None and found["age"] > 0.2 else None

        held = wait_until(named)
        assert held["pid"] == pid and held["application_name"] == "forgotten-psql"
        assert held["state"] == "idle in transaction" and held["query"] == "SELECT 1"
        assert held["xmin_age"] is not None
        # Under the default threshold (5 minutes) it is not worth a warning yet.
        assert _snapshot(dsn)["health"]["transaction"] is None
        holder.execute("COMMIT")
        assert _snapshot(dsn, long_transaction=0.2)["health"]["transaction"] is None


def test_past_the_cap_dead_jobs_are_counted_in_full_only_every_so_often_and_deaths_since_added(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past DEAD_ALWAYS_COUNTED a refresh does not read every dead row: the full count is kept
    for DEAD_RECOUNT_SECONDS and the jobs that died since are added to it at once; a job that
    leaves the dead (requeued) leaves the figures at the next full count, and at once when the
    dead fall back under the cap."""
    monkeypatch.setattr(queries, "DEAD_ALWAYS_COUNTED", 1)
    dead = (
        "INSERT INTO pgqueue_jobs (queue, task, status, finished_at)"
        " VALUES (%s, 't', 'dead', now()) RETURNING id"
    )

    async def go() -> list[tuple[int, dict[str, int]]]:
        database = Database(dsn)
        refresher = Refresher(database, "public")
        seen = []

        async def look() -> None:
            snap = await refresher.refresh_once()
            seen.append((snap["problem_counts"]["dead"], _dead(snap)))

        try:
            first = conn.execute(dead, ("a",)).fetchone()
            conn.execute(dead, ("a",))
            await look()  # full count: 2 > cap
            conn.execute(dead, ("b",))
            await look()  # b died since: added without a full count
            assert first is not None
            conn.execute("UPDATE pgqueue_jobs SET status = 'queued' WHERE id = %s", first)
            await look()  # requeued: still counted until the next full count
            monkeypatch.setattr(queries, "DEAD_RECOUNT_SECONDS", 0.0)
            await look()
            conn.execute("UPDATE pgqueue_jobs SET status = 'queued' WHERE queue = 'a'")
            await look()  # under the cap: exact again at once
        finally:
            await database.close()
        return seen

    assert asyncio.run(go()) == [
        (2, {"a": 2}),
        (3, {"a": 2, "b": 1}),
        (3, {"a": 2, "b": 1}),
        (2, {"a": 1, "b": 1}),
        (1, {"b": 1}),
    ]


def _dead(snap: dict[str, Any]) -> dict[str, int]:
    return {r["queue"]: r["dead"] for r in snap["queues"] if r["dead"]}


def test_a_role_that_may_not_read_the_rate_logs_or_other_sessions_still_gets_the_table(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A dashboard role granted before pgqueue_rates was read, and without pg_read_all_stats:
    the table comes without a rate's use, and the strip counts the sessions it cannot see."""
    role = f"pgqueue_old_dashboard_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    try:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'pw'").format(ident))
    except psycopg.errors.InsufficientPrivilege:
        pytest.skip("this test server does not let the test user create roles")
    try:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
        conn.execute(
            sql.SQL(
                "GRANT SELECT ON pgqueue_jobs, pgqueue_workers, pgqueue_schedules, pgqueue_stats,"
                " pgqueue_depth, pgqueue_queues, pgqueue_job_deps TO {}"
            ).format(ident)
        )
        conn.execute(
            "INSERT INTO pgqueue_queues (name, rate_limit, rate_period) VALUES ('rated', 5, 60)"
        )
        conn.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('rated', 't')")
        snap = _snapshot(conninfo.make_conninfo(dsn, user=role, password="pw"))
        rated = _by_queue(snap)["rated"]
        assert (rated["queued"], rated["rate_limit"], rated["rate_used"]) == (1, 5, None)
        assert snap["health"]["hidden_sessions"] >= 1  # this test's own superuser session
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_the_cli_refuses_nonsense_health_thresholds(dsn: str) -> None:
    for option in ("--long-transaction", "--dead-tuples"):
        result = CliRunner().invoke(dashboard_command, ["--dsn", dsn, option, "0"])
        assert result.exit_code == 2 and "thresholds must be positive" in result.output
        assert "Traceback" not in result.output
