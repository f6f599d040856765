"""Who owns a schedule: the app that declared it (``App(name=...)``). A worker's sync writes only
its own app's schedules and never stops one; retiring is explicit (prune, retire_schedule), and
two services or two versions of one app share a database without losing each other's ticks."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg_pool import AsyncConnectionPool

import pgqueue
from pgqueue.migrate import available
from pgqueue.schedules_cli import schedules_command
from pgqueue.sql import render
from pgqueue.worker.scheduler import Scheduler
from tests.helpers import minute_ahead_of, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
SECOND = timedelta(seconds=1)
OWNERS = 6  # the migration that gives schedules their owning app


_apps: list[pgqueue.App] = []


def make_app(
    dsn: str, *schedules: str, name: str | None = None, cron: str = "@daily"
) -> pgqueue.App:
    """An app declaring ``schedules`` (all with ``cron``); ``name=None`` keeps the default."""
    app = pgqueue.App(dsn) if name is None else pgqueue.App(dsn, name=name)
    app.task(name="tick")(lambda: None)
    for schedule in schedules:
        app.schedule(schedule, cron, task="tick", missed="all")
    _apps.append(app)
    return app


@pytest.fixture(autouse=True)
def _close_apps() -> Iterator[None]:
    """prune_schedules opens an app's producer pool: close every app a test made."""
    yield
    while _apps:
        _apps.pop().close()


async def sync(app: pgqueue.App) -> None:
    async with await psycopg.AsyncConnection.connect(app.dsn, autocommit=True) as conn:
        await Scheduler(app).sync(conn)


async def tick(app: pgqueue.App) -> int:
    async with await psycopg.AsyncConnection.connect(app.dsn, autocommit=True) as conn:
        return await Scheduler(app).tick(conn)


def state(conn: Conn) -> dict[str, tuple[Any, ...]]:
    """name → (owner, cron, enabled, next_run_at)."""
    found = conn.execute(
        "SELECT name, app, cron, enabled, next_run_at FROM pgqueue_schedules ORDER BY name"
    ).fetchall()
    return {str(r[0]): tuple(r[1:]) for r in found}


def make_due(conn: Conn, *names: str) -> None:
    conn.execute(
        "UPDATE pgqueue_schedules SET next_run_at = date_trunc('second', now()) - interval '1 h' "
        "WHERE name = ANY(%s)",
        (list(names),),
    )


def fired(conn: Conn) -> dict[str, list[datetime]]:
    """Each schedule's ticks, oldest first; fails if a tick has more than one job."""
    rows = conn.execute(
        "SELECT schedule_name, schedule_tick, count(*) FROM pgqueue_jobs "
        "WHERE schedule_name IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2"
    ).fetchall()
    assert all(count == 1 for *_, count in rows), "a tick got more than one job"
    ticks: dict[str, list[datetime]] = {}
    for name, tick_at, _ in rows:
        ticks.setdefault(str(name), []).append(tick_at)
    return ticks


@asynccontextmanager
async def scheduling(app: pgqueue.App) -> AsyncIterator[Scheduler]:
    """A worker's scheduler for the block: it syncs (as a worker does when it starts), then
    fires due ticks until the block ends."""
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
        app.dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
    )
    await pool.open()
    scheduler = Scheduler(app, interval=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(pool, stop))
    try:
        await wait_until_async(lambda: scheduler.synced or task.done(), timeout=15)
        yield scheduler
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await pool.close()


# --- no implicit disabling ----------------------------------------------------------------------


@pytest.mark.parametrize("other", [None, "reports"], ids=["same-default-name", "own-name"])
async def test_worker_of_an_app_without_schedules_leaves_other_schedules_enabled_and_firing(
    dsn: str, conn: Conn, other: str | None
) -> None:
    """A second service on the same database (here: the same default name, or its own) whose
    app declares no schedules starts a worker: the first service's schedules keep firing."""
    billing = make_app(dsn, "invoices", "reminders")
    await sync(billing)
    empty = make_app(dsn, name=other)
    await sync(empty)
    assert {name: row[2] for name, row in state(conn).items()} == {
        "invoices": True,
        "reminders": True,
    }
    make_due(conn, "invoices", "reminders")
    assert await tick(empty) == 2  # any worker fires any live schedule


async def test_sync_leaves_undeclared_schedules_of_its_own_app_firing_and_says_so(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    await sync(make_app(dsn, "report", "gone", name="billing"))
    with caplog.at_level(logging.WARNING, "pgqueue.worker.scheduler"):
        await sync(make_app(dsn, "report", name="billing"))
    assert state(conn)["gone"][2] is True
    assert "schedules of app 'billing' that this code does not declare keep firing: gone" in (
        caplog.text
    )


async def test_two_versions_side_by_side_lose_no_ticks(dsn: str, conn: Conn) -> None:
    """A rolling deploy: v1 declares {x, y}, v2 declares {x, z}; v1 runs, v2 starts, then a v1
    worker restarts (and syncs again) while v2 still runs. Every tick of x, y and z is fired
    exactly once from the schedule's first tick on, while both versions run."""
    v1 = make_app(dsn, "x", "y", cron="* * * * * *")
    v2 = make_app(dsn, "x", "z", cron="* * * * * *")

    def count_since(since: datetime | None, names: Iterable[str], n: int) -> bool:
        ticks = fired(conn)
        return all(
            len([t for t in ticks.get(name, []) if since is None or t > since]) >= n
            for name in names
        )

    async with scheduling(v1):
        await wait_until_async(lambda: count_since(None, "xy", 2), timeout=30)
        async with scheduling(v2):
            await wait_until_async(lambda: count_since(None, "z", 2), timeout=30)
            async with scheduling(v1):  # a v1 worker restarts mid-deploy
                restarted = conn.execute("SELECT now()").fetchone()
                assert restarted is not None
                await wait_until_async(lambda: count_since(restarted[0], "xyz", 3), timeout=30)
    ticks = fired(conn)
    for name in "xyz":
        gaps = [(a, b) for a, b in pairwise(ticks[name]) if b - a != SECOND]
        assert not gaps, f"schedule {name}: ticks missing between {gaps}"
    assert all(row[2] for row in state(conn).values())


async def test_versions_declaring_one_schedule_with_different_crons_follow_the_last_started(
    dsn: str, conn: Conn
) -> None:
    """The last worker to start writes the schedule, and the schedulers of both versions fire
    that one row: each tick still gets exactly one job."""
    v1 = make_app(dsn, "x", cron="*/2 * * * * *")
    v2 = make_app(dsn, "x", cron="*/3 * * * * *")
    await sync(v1)
    await sync(v2)
    assert state(conn)["x"][1] == "*/3 * * * * *"
    await sync(v1)  # a v1 worker restarts
    assert state(conn)["x"][1] == "*/2 * * * * *"
    make_due(conn, "x")
    results = await asyncio.gather(tick(v1), tick(v2))  # both versions' schedulers fire
    ticks = fired(conn)["x"]  # one job per tick (fired() checks), on the stored cron's grid
    assert sum(results) == len(ticks) > 0 and all(t.second % 2 == 0 for t in ticks)


# --- names owned by another app ----------------------------------------------------------------


async def test_a_name_owned_by_another_app_is_refused_with_a_clear_error(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    await sync(make_app(dsn, "cleanup", name="billing", cron="0 3 * * *"))
    before = state(conn)["cleanup"]
    intruder = make_app(dsn, "cleanup", "mine", name="invoicing", cron="*/5 * * * *")
    with caplog.at_level(logging.ERROR, "pgqueue.worker.scheduler"):
        await sync(intruder)
    after = state(conn)
    assert after["cleanup"] == before  # owner, cron, enabled and next tick all unchanged
    assert after["mine"][0] == "invoicing"  # the rest of the sync went ahead
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "schedule 'cleanup' belongs to app 'billing', not to app 'invoicing' which declares it: "
        "left as it is. Give one of them another schedule name or, if 'invoicing' is 'billing' "
        "renamed, run `pgqueue schedules transfer billing invoicing`"
    ]


async def test_an_app_cannot_retire_another_apps_schedule(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    await sync(make_app(dsn, "cleanup", name="billing"))
    other = make_app(dsn, name="invoicing")
    other.retire_schedule("cleanup")
    with caplog.at_level(logging.ERROR, "pgqueue.worker.scheduler"):
        await sync(other)
    assert other.prune_schedules() == []
    assert state(conn)["cleanup"][:3] == ("billing", "@daily", True)
    assert "belongs to app 'billing', not to app 'invoicing' which retires it" in caplog.text


async def test_transfer_hands_a_renamed_apps_schedules_over(dsn: str, conn: Conn) -> None:
    await sync(make_app(dsn, "cleanup", "report", name="billing"))
    make_due(conn, "report")
    conn.execute("UPDATE pgqueue_schedules SET paused = true WHERE name = 'cleanup'")
    before = state(conn)
    runner = CliRunner()
    result = runner.invoke(schedules_command, ["transfer", "billing", "invoicing", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "schedule 'cleanup': app 'billing' -> 'invoicing'",
        "schedule 'report': app 'billing' -> 'invoicing'",
    ]
    renamed = make_app(dsn, "cleanup", "report", name="invoicing")
    await sync(renamed)
    after = state(conn)
    assert {name: row[0] for name, row in after.items()} == {
        "cleanup": "invoicing",
        "report": "invoicing",
    }
    assert after["report"][1:] == before["report"][1:]  # the due tick is still due
    assert conn.execute(
        "SELECT paused FROM pgqueue_schedules WHERE name = 'cleanup'"
    ).fetchone() == (True,)
    for args, message in [
        (["transfer", "billing", "invoicing"], "error: no schedules belong to app 'billing'"),
        (["transfer", "a", "a"], "error: OLD_APP and NEW_APP are both 'a': nothing to transfer"),
        (["transfer", "a", ""], "error: app name must not be empty"),
    ]:
        result = runner.invoke(schedules_command, [*args, "--dsn", dsn])
        assert result.exit_code == 1 and result.output.strip() == message


async def test_transfer_of_named_schedules_splits_two_services_that_shared_the_default_name(
    dsn: str, conn: Conn
) -> None:
    """Before apps had names, two services on one database both owned their schedules as
    `default`. Giving them names is a transfer of each one's schedules, by name."""
    await sync(make_app(dsn, "invoices", "reminders", "exports"))
    runner = CliRunner()
    refused = runner.invoke(
        schedules_command, ["transfer", "default", "billing", "invoices", "nope", "--dsn", dsn]
    )
    assert refused.exit_code == 1
    assert refused.output.strip() == (
        "error: no schedule named 'nope' belongs to app 'default'; nothing transferred"
    )
    assert {row[0] for row in state(conn).values()} == {"default"}  # all or nothing
    result = runner.invoke(
        schedules_command, ["transfer", "default", "billing", "invoices", "reminders", "--dsn", dsn]
    )
    assert result.exit_code == 0, result.output
    await sync(make_app(dsn, "invoices", "reminders", name="billing"))
    await sync(make_app(dsn, "exports"))  # the other service keeps the default name
    assert {name: row[0] for name, row in state(conn).items()} == {
        "exports": "default",
        "invoices": "billing",
        "reminders": "billing",
    }


# --- explicit retirement ------------------------------------------------------------------------


async def test_prune_retires_only_its_own_apps_undeclared_schedules(dsn: str, conn: Conn) -> None:
    await sync(make_app(dsn, "keep", "old", "older", name="billing"))
    await sync(make_app(dsn, "theirs", name="reports"))
    await sync(make_app(dsn, "unnamed"))  # the default app
    v2 = make_app(dsn, "keep", name="billing")

    assert v2.prune_schedules(dry_run=True) == ["old", "older"]
    assert all(row[2] for row in state(conn).values())  # a dry run changes nothing
    assert v2.prune_schedules() == ["old", "older"]
    assert {name: row[2] for name, row in state(conn).items()} == {
        "keep": True,
        "old": False,
        "older": False,
        "theirs": True,
        "unnamed": True,
    }
    assert v2.prune_schedules() == []
    make_due(conn, "keep", "old", "older", "theirs", "unnamed")
    assert await tick(v2) == 3  # retired schedules no longer fire
    assert sorted(fired(conn)) == ["keep", "theirs", "unnamed"]


async def test_prune_cli_prints_what_it_retires(
    dsn: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sync(make_app(dsn, "keep", "old", name="billing"))
    await sync(make_app(dsn, "theirs", name="reports"))
    module = f"prune_app_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "import pgqueue\n"
        "app = pgqueue.App(name='billing')\n"
        "app.task(name='tick')(lambda: None)\n"
        "app.schedule('keep', '@daily', task='tick')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    runner = CliRunner()
    spec = f"{module}:app"

    result = runner.invoke(schedules_command, ["prune", "--app", spec, "--dry-run", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert result.output == "would retire schedule 'old' of app 'billing'\n"
    assert state(conn)["old"][2] is True
    result = runner.invoke(schedules_command, ["--dsn", dsn, "prune", "--app", spec])
    assert result.exit_code == 0, result.output
    assert result.output == "retired schedule 'old' of app 'billing'\n"
    assert {name: row[2] for name, row in state(conn).items()} == {
        "keep": True,
        "old": False,
        "theirs": True,
    }
    listing = runner.invoke(schedules_command, ["--dsn", dsn]).output.splitlines()
    old = next(line for line in listing if line.startswith("old "))
    assert " billing " in old and "retired" in old
    result = runner.invoke(schedules_command, ["prune", "--app", spec, "--dsn", dsn])
    assert result.output == "app 'billing' declares every live schedule it owns: nothing to prune\n"
    result = runner.invoke(schedules_command, ["prune", "--app", "nope:app", "--dsn", dsn])
    assert result.exit_code == 1 and result.output.startswith("error: cannot import 'nope'")


async def test_declared_retirement_applies_at_the_next_sync_and_redeclaring_revives(
    dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    minute_ahead_of(conn)  # its last check compares an every-minute tick with now()
    await sync(make_app(dsn, "keep", "old", cron="* * * * *"))
    v2 = make_app(dsn, "keep")
    v2.retire_schedule("old")
    v2.retire_schedule("never-existed")
    with caplog.at_level(logging.INFO, "pgqueue.worker.scheduler"):
        await sync(v2)
    assert {name: row[2] for name, row in state(conn).items()} == {"keep": True, "old": False}
    assert "schedules retired by app 'default': old" in caplog.text
    assert "keep firing" not in caplog.text
    make_due(conn, "old")
    assert await tick(v2) == 0

    await sync(make_app(dsn, "keep", "old", cron="* * * * *"))  # declared again
    row = conn.execute(
        "SELECT enabled, next_run_at > now() FROM pgqueue_schedules WHERE name = 'old'"
    ).fetchone()
    assert row == (True, True)  # back, from its next future tick: no catch-up of the retirement


# --- upgrade ------------------------------------------------------------------------------------


def test_upgrade_gives_existing_schedules_to_the_default_app(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        with conn.transaction():
            for migration in available():
                if migration.version < OWNERS:
                    conn.execute(render(migration.text, "public"))
        conn.execute(
            "INSERT INTO pgqueue_schedules (name, cron, task, queue, next_run_at, enabled) "
            "VALUES ('a', '@daily', 't', 'default', now(), true), "
            "       ('b', '@daily', 't', 'default', now(), false)"
        )
        (owners,) = [m for m in available() if m.version == OWNERS]
        with conn.transaction():
            conn.execute(render(owners.text, "public"))
        rows = conn.execute(
            "SELECT name, app, enabled FROM pgqueue_schedules ORDER BY name"
        ).fetchall()
    assert rows == [("a", "default", True), ("b", "default", False)]
