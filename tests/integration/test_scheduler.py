"""The scheduler against a real database: sync, exactly-once firing, missed ticks, pause, CLI."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue.schedules_cli import schedules_command
from pgqueue.worker.scheduler import Scheduler
from tests.helpers import minute_ahead_of, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


def declare(app: pgqueue.App, *specs: tuple[str, str]) -> None:
    if "tick" not in app.tasks:
        app.task(name="tick")(lambda: None)
    for name, cron in specs:
        app.schedule(name, cron, task="tick")


async def aconnect(dsn: str) -> psycopg.AsyncConnection[tuple[Any, ...]]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def sync(app: pgqueue.App) -> None:
    async with await aconnect(app.dsn) as conn:
        await Scheduler(app).sync(conn)


def rows(conn: Conn) -> dict[str, tuple[Any, ...]]:
    found = conn.execute(
        "SELECT name, cron, enabled, paused, next_run_at, next_run_at > now() "
        "FROM pgqueue_schedules ORDER BY name"
    ).fetchall()
    return {str(r[0]): tuple(r[1:]) for r in found}


def make_due(conn: Conn, name: str, ago: str) -> None:
    """Put a schedule's next tick in the past, as if every worker had been down."""
    conn.execute(
        "UPDATE pgqueue_schedules SET next_run_at = date_trunc('second', now()) - %s::interval "
        "WHERE name = %s",
        (ago, name),
    )


@pytest.fixture
def minute_ahead(conn: Conn) -> None:
    """For tests that compare an every-minute (or every-five-minutes) schedule's next tick
    with now() (see helpers.minute_ahead_of)."""
    minute_ahead_of(conn)


def jobs(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT schedule_name, schedule_tick, task, queue, status::text FROM pgqueue_jobs "
        "WHERE schedule_name IS NOT NULL ORDER BY schedule_tick"
    ).fetchall()


# --- sync ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("minute_ahead")
async def test_sync_inserts_declared_schedules_with_a_future_tick(
    app: pgqueue.App, conn: Conn
) -> None:
    declare(app, ("a", "* * * * *"), ("b", "@daily"))
    await sync(app)
    found = rows(conn)
    assert {name: (r[0], r[1], r[2], r[4]) for name, r in found.items()} == {
        "a": ("* * * * *", True, False, True),
        "b": ("@daily", True, False, True),
    }


@pytest.mark.usefixtures("minute_ahead")
async def test_sync_keeps_next_run_when_cron_is_unchanged_and_recomputes_when_changed(
    dsn: str, conn: Conn
) -> None:
    first = pgqueue.App(dsn)
    declare(first, ("keep", "0 3 * * *"), ("change", "0 3 * * *"))
    await sync(first)
    conn.execute("UPDATE pgqueue_schedules SET next_run_at = now() + interval '5 days'")
    before = rows(conn)

    second = pgqueue.App(dsn)
    declare(second, ("keep", "0 3 * * *"), ("change", "*/5 * * * *"))
    await sync(second)
    after = rows(conn)
    assert after["keep"][3] == before["keep"][3]
    assert after["change"][0] == "*/5 * * * *"
    minutes_away = conn.execute(
        "SELECT extract(epoch FROM next_run_at - now()) / 60 FROM pgqueue_schedules "
        "WHERE name = 'change'"
    ).fetchone()
    assert minutes_away is not None and 0 < float(minutes_away[0]) <= 5


async def test_removed_schedule_keeps_firing_until_pruned_and_renamed_one_is_a_new_row(
    dsn: str, conn: Conn
) -> None:
    old = pgqueue.App(dsn)
    declare(old, ("report", "@hourly"), ("gone", "@daily"))
    await sync(old)

    new = pgqueue.App(dsn)
    declare(new, ("report-v2", "@hourly"))
    await sync(new)
    assert {name: r[1] for name, r in rows(conn).items()} == {
        "gone": True,
        "report": True,
        "report-v2": True,
    }
    assert new.prune_schedules() == ["gone", "report"]
    new.close()
    assert {name: r[1] for name, r in rows(conn).items()} == {
        "gone": False,
        "report": False,
        "report-v2": True,
    }
    make_due(conn, "report", "1 hour")
    make_due(conn, "report-v2", "1 hour")
    async with await aconnect(dsn) as aconn:
        assert await Scheduler(new).tick(aconn) == 1
    assert [j[0] for j in jobs(conn)] == ["report-v2"]


async def test_sync_never_touches_paused(app: pgqueue.App, conn: Conn) -> None:
    declare(app, ("a", "* * * * *"))
    await sync(app)
    conn.execute("UPDATE pgqueue_schedules SET paused = true")
    await sync(app)
    assert rows(conn)["a"][2] is True


@pytest.mark.usefixtures("minute_ahead")
async def test_redeclared_schedule_does_not_catch_up_the_time_it_was_retired(
    dsn: str, conn: Conn
) -> None:
    app = pgqueue.App(dsn)
    declare(app, ("a", "* * * * *"))
    await sync(app)
    without = pgqueue.App(dsn)  # a deploy without it, pruned
    assert without.prune_schedules() == ["a"]
    without.close()
    make_due(conn, "a", "1 hour")
    await sync(app)  # declared again
    assert rows(conn)["a"][1:] == (True, False, rows(conn)["a"][3], True)


# --- firing -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("minute_ahead")
async def test_due_schedule_fires_an_ordinary_tagged_job_and_advances(
    app: pgqueue.App, conn: Conn
) -> None:
    app.task(name="cleanup", queue="maintenance", max_attempts=3)(lambda days: None)
    app.schedule("cleanup", "*/5 * * * *", task="cleanup", args={"days": 30})
    await sync(app)
    conn.execute(
        "UPDATE pgqueue_schedules SET next_run_at = date_trunc('hour', now()) - interval '1 hour'"
    )
    async with await aconnect(app.dsn) as aconn:
        assert await Scheduler(app).tick(aconn) == 1
        assert await Scheduler(app).tick(aconn) == 0
    job = conn.execute(
        "SELECT id, task, queue, args, max_attempts, status::text, schedule_name, schedule_tick, "
        "run_at = schedule_tick FROM pgqueue_jobs"
    ).fetchone()
    assert job is not None
    assert job[1:7] == ("cleanup", "maintenance", {"days": 30}, 3, "queued", "cleanup")
    assert job[8] is True
    state = conn.execute(
        "SELECT last_run_at, last_job_id, next_run_at > now(), "
        "next_run_at - last_run_at <= interval '5 minutes' FROM pgqueue_schedules"
    ).fetchone()
    assert state == (job[7], job[0], True, True)


async def test_concurrent_ticks_fire_each_tick_exactly_once(dsn: str, conn: Conn) -> None:
    app = pgqueue.App(dsn)
    declare(app, *((f"s{i}", "* * * * * *") for i in range(5)))
    await sync(app)
    schedulers = [Scheduler(app) for _ in range(6)]
    conns = [await aconnect(dsn) for _ in schedulers]
    try:
        for _ in range(15):
            conn.execute(
                "UPDATE pgqueue_schedules SET next_run_at = date_trunc('second', now()) "
                "- make_interval(secs => floor(random() * 3))"
            )
            await asyncio.gather(*(s.tick(c) for s, c in zip(schedulers, conns, strict=True)))
    finally:
        for c in conns:
            await c.close()
    fired = jobs(conn)
    per_tick = Counter((name, tick) for name, tick, *_ in fired)
    assert per_tick and max(per_tick.values()) == 1
    assert sum(s.fired for s in schedulers) == len(fired)


def waits_on_a_lock(conn: Conn, pid: int) -> bool:
    row = conn.execute(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and bool(row[0])


async def test_unique_key_refuses_a_second_job_for_the_same_tick(
    app: pgqueue.App, conn: Conn
) -> None:
    """Two transactions that both got past the lock (simulated: neither takes it) still leave
    one job for the tick."""
    declare(app, ("race", "* * * * *"))
    await sync(app)
    tick = conn.execute("SELECT date_trunc('minute', now())").fetchone()
    assert tick is not None
    a, b = await aconnect(app.dsn), await aconnect(app.dsn)
    params = {"names": ["race"], "ticks": [tick[0]], "limit_keys": [None]}

    async def insert_in_b() -> list[Any]:
        async with b.transaction():
            return await (await b.execute(app.q.insert_schedule_jobs, params)).fetchall()

    try:
        async with a.transaction():
            first = await (await a.execute(app.q.insert_schedule_jobs, params)).fetchall()
            second = asyncio.create_task(insert_in_b())
            await wait_until_async(lambda: waits_on_a_lock(conn, b.info.backend_pid))
            assert not second.done()  # b waits on a's uncommitted index entry
        inserted_by_b = await asyncio.wait_for(second, 10)
    finally:
        await a.close()
        await b.close()
    assert len(first) == 1 and inserted_by_b == []
    assert len(jobs(conn)) == 1


@pytest.mark.usefixtures("minute_ahead")
async def test_missed_latest_fires_once_for_the_newest_missed_tick(
    app: pgqueue.App, conn: Conn
) -> None:
    declare(app, ("m", "* * * * *"))
    await sync(app)
    make_due(conn, "m", "30 minutes")
    async with await aconnect(app.dsn) as aconn:
        assert await Scheduler(app).tick(aconn) == 1
    ((_, tick, *_),) = jobs(conn)
    fresh = conn.execute(
        "SELECT %s > now() - interval '1 minute', next_run_at > now() FROM pgqueue_schedules",
        (tick,),
    ).fetchone()
    assert fresh == (True, True)


@pytest.mark.usefixtures("minute_ahead")
async def test_missed_all_fires_every_tick_up_to_max_catchup(app: pgqueue.App, conn: Conn) -> None:
    app.task(name="tick")(lambda: None)
    app.schedule("few", "* * * * *", task="tick", missed="all", max_catchup=100)
    app.schedule("many", "* * * * *", task="tick", missed="all", max_catchup=10)
    await sync(app)
    make_due(conn, "few", "5 minutes")
    make_due(conn, "many", "3 hours")
    async with await aconnect(app.dsn) as aconn:
        await Scheduler(app).tick(aconn)
    counts = Counter(name for name, *_ in jobs(conn))
    assert counts["many"] == 10
    assert counts["few"] in (5, 6)  # 5 minutes back, plus the current minute's tick if passed
    assert conn.execute(
        "SELECT bool_and(next_run_at > now()) FROM pgqueue_schedules"
    ).fetchone() == (True,)


@pytest.mark.usefixtures("minute_ahead")
async def test_paused_schedule_does_not_fire_and_resume_skips_the_pause(
    app: pgqueue.App, conn: Conn, dsn: str
) -> None:
    declare(app, ("p", "* * * * *"))
    await sync(app)
    runner = CliRunner()
    result = runner.invoke(schedules_command, ["pause", "p", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    make_due(conn, "p", "10 minutes")
    async with await aconnect(dsn) as aconn:
        assert await Scheduler(app).tick(aconn) == 0
        result = runner.invoke(schedules_command, ["--dsn", dsn, "resume", "p"])
        assert result.exit_code == 0 and "resumed" in result.output
        assert await Scheduler(app).tick(aconn) == 0
    assert rows(conn)["p"][2:] == (False, rows(conn)["p"][3], True)


async def scheduler_pool(app: pgqueue.App) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
    """A pool like the worker's, for running the scheduler alone."""
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        app.dsn, min_size=1, kwargs={"autocommit": True}, open=False
    )
    await pool.open()
    return pool


async def test_run_loop_fires_and_stops(app: pgqueue.App, conn: Conn) -> None:
    declare(app, ("loop", "* * * * * *"))
    pool = await scheduler_pool(app)
    stop = asyncio.Event()
    scheduler = Scheduler(app, interval=0.2)
    task = asyncio.create_task(scheduler.run(pool, stop))
    try:
        async with asyncio.timeout(10):
            while len(jobs(conn)) < 2:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await pool.close()
    assert scheduler.synced
    ticks = [tick for _, tick, *_ in jobs(conn)]
    assert len(set(ticks)) == len(ticks)


# --- CLI ----------------------------------------------------------------------------------------


async def test_cli_lists_schedules_like_the_dashboard(app: pgqueue.App, dsn: str) -> None:
    declare(app, ("nightly-report", "0 3 * * *"), ("cleanup", "*/5 * * * *"))
    await sync(app)
    result = CliRunner().invoke(schedules_command, ["--dsn", dsn])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split("  ")[0] == "Name"
    for column in ("App", "Cron (UTC)", "Task", "Queue", "Next run", "Last run"):
        assert column in header
    assert lines[0].startswith("cleanup") and "*/5 * * * *" in lines[0] and "UTC" in lines[0]
    assert lines[1].startswith("nightly-report") and "0 3 * * *" in lines[1]
    assert all(line.split()[1] == "default" for line in lines)  # the owning app


def test_cli_empty_and_unknown_names(dsn: str) -> None:
    runner = CliRunner()
    assert runner.invoke(schedules_command, ["--dsn", dsn]).output == "No schedules\n"
    for action in ("pause", "resume"):
        result = runner.invoke(schedules_command, [action, "nope", "--dsn", dsn])
        assert result.exit_code == 1
        assert result.output.strip() == "error: no schedule named 'nope'"


@pytest.mark.parametrize("args", [["--dsn", "postgresql://127.0.0.1:1/none"]])
def test_cli_unreachable_database_is_one_line(args: list[str]) -> None:
    result = CliRunner().invoke(schedules_command, args)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1


async def test_run_loop_survives_database_errors_and_still_stops(
    empty_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No pgqueue tables at all: every round fails, is logged, and is retried with backoff."""
    app = pgqueue.App(empty_dsn)
    declare(app, ("x", "* * * * *"))
    pool = await scheduler_pool(app)
    stop = asyncio.Event()
    task = asyncio.create_task(Scheduler(app, interval=0.1).run(pool, stop))
    try:
        async with asyncio.timeout(10):
            while "scheduler round" not in caplog.text:
                await asyncio.sleep(0.05)
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await pool.close()


@pytest.mark.parametrize("how", ["task", "key", "operator"])
async def test_a_scheduled_job_of_a_limited_task_gets_its_limit_group(
    app: pgqueue.App, conn: Conn, how: str
) -> None:
    """A schedule's job is enqueued like any other: a limited task's job gets its limit group
    when it is inserted (the key of its arguments under a per-key limit, '' for a task-wide one,
    and '' from the database when the firing worker's code leaves the task unlimited, as for an
    operator's limit), so the limited claim takes it under the limit. Without it, every tick of
    a limited task's schedule ran unlimited, or was given back by the claim with a warning."""
    per_key = how == "key"
    app.task(
        name="sync",
        limit=None if how == "operator" else 1,
        limit_key=(lambda args: args["tenant"]) if per_key else None,
    )(lambda tenant: None)
    app.schedule("sync-a", "*/5 * * * *", task="sync", args={"tenant": "a"})
    if how == "operator":
        app.limit_task("sync", limit=1)
    await sync(app)
    make_due(conn, "sync-a", "1 minute")
    async with await aconnect(app.dsn) as aconn:
        assert await Scheduler(app).tick(aconn) == 1
    groups = conn.execute("SELECT task, limit_key FROM pgqueue_jobs").fetchall()
    assert groups == [("sync", "a" if per_key else "")]
