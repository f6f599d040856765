"""Cron parsing, declarations and the missed-tick arithmetic: pure functions, no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

import pgqueue
from pgqueue.schedules import ALIASES, due_ticks, next_tick, normalize_cron


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("*/5 * * * *", "2026-01-01 10:02:30", "2026-01-01 10:05:00"),
        ("0 3 * * *", "2026-01-01 03:00:00", "2026-01-02 03:00:00"),
        ("*/10 * * * * *", "2026-01-01 10:00:01.5", "2026-01-01 10:00:10"),
        ("* * * * * *", "2026-01-01 10:00:00", "2026-01-01 10:00:01"),
        ("@hourly", "2026-01-01 10:00:00", "2026-01-01 11:00:00"),
        ("@daily", "2026-01-01 10:00:00", "2026-01-02 00:00:00"),
        ("@midnight", "2026-01-01 10:00:00", "2026-01-02 00:00:00"),
        ("@weekly", "2026-01-01 10:00:00", "2026-01-04 00:00:00"),  # the next Sunday
        ("@monthly", "2026-01-15 10:00:00", "2026-02-01 00:00:00"),
        ("@yearly", "2026-01-15 10:00:00", "2027-01-01 00:00:00"),
        ("@annually", "2026-01-15 10:00:00", "2027-01-01 00:00:00"),
    ],
)
def test_next_tick_is_strictly_after_and_in_utc(expr: str, after: str, expected: str) -> None:
    assert next_tick(normalize_cron(expr), at(after)) == at(expected)


def test_ticks_are_utc_whatever_the_sessions_timezone() -> None:
    # 03:00 in UTC+02:00 is 01:00 UTC: a daily 03:00 UTC schedule fires at 03:00 UTC that day.
    local = datetime(2026, 1, 1, 3, 0, tzinfo=timezone(timedelta(hours=2)))
    assert next_tick("0 3 * * *", local) == at("2026-01-01 03:00:00")


def test_cron_text_is_normalized() -> None:
    assert normalize_cron("  */5   *  * * * ") == "*/5 * * * *"
    assert normalize_cron("@DAILY") == "@daily"
    assert set(ALIASES) >= {"@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@midnight"}


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("* * * *", "expected 5 fields"),
        ("* * * * * * *", "got 7"),
        ("61 * * * *", "invalid cron expression"),
        ("* 25 * * *", "invalid cron expression"),
        ("every minute", "expected 5 fields"),
        ("@reboot", "unknown cron alias"),
        ("0 0 31 2 *", "invalid cron expression"),
        ("", "got 0"),
    ],
)
def test_malformed_cron_is_a_configuration_error(expr: str, message: str) -> None:
    with pytest.raises(pgqueue.ConfigurationError, match=message):
        normalize_cron(expr)


def test_tick_on_time_fires_just_that_tick() -> None:
    ticks, following = due_ticks(
        "* * * * *", at("2026-01-01 10:00:00"), at("2026-01-01 10:00:00.3")
    )
    assert ticks == [at("2026-01-01 10:00:00")]
    assert following == at("2026-01-01 10:01:00")


def test_not_yet_due_fires_nothing() -> None:
    ticks, following = due_ticks("* * * * *", at("2026-01-01 10:01:00"), at("2026-01-01 10:00:59"))
    assert ticks == [] and following == at("2026-01-01 10:01:00")


def test_latest_fires_only_the_most_recent_missed_tick() -> None:
    ticks, following = due_ticks(
        "*/5 * * * *", at("2026-01-01 10:00:00"), at("2026-01-01 12:07:00"), "latest"
    )
    assert ticks == [at("2026-01-01 12:05:00")]
    assert following == at("2026-01-01 12:10:00")


def test_all_fires_every_missed_tick_oldest_first() -> None:
    ticks, following = due_ticks(
        "*/5 * * * *", at("2026-01-01 10:00:00"), at("2026-01-01 10:17:00"), "all", 100
    )
    assert ticks == [at(f"2026-01-01 10:{m:02d}:00") for m in (0, 5, 10, 15)]
    assert following == at("2026-01-01 10:20:00")


def test_all_keeps_only_the_newest_max_catchup_ticks() -> None:
    ticks, following = due_ticks(
        "* * * * * *", at("2026-01-01 00:00:00"), at("2026-01-08 00:00:00.5"), "all", 3
    )
    assert ticks == [
        at("2026-01-07 23:59:58"),
        at("2026-01-07 23:59:59"),
        at("2026-01-08 00:00:00"),
    ]
    assert following == at("2026-01-08 00:00:01")


def test_off_grid_next_run_at_still_fires() -> None:
    ticks, following = due_ticks("0 * * * *", at("2026-01-01 10:30:00"), at("2026-01-01 10:45:00"))
    assert ticks == [at("2026-01-01 10:30:00")]
    assert following == at("2026-01-01 11:00:00")


# --- declarations -----------------------------------------------------------------------------


def test_periodic_decorator_declares_with_task_defaults() -> None:
    app = pgqueue.App("postgresql://unused/x")

    @app.periodic(cron="*/5 * * * *", name="cleanup", queue="maintenance", args={"days": 30})
    @app.task(priority=3, max_attempts=2)
    def cleanup(days: int) -> None: ...

    schedule = app.periodic_schedules["cleanup"]
    assert (schedule.task, schedule.queue, schedule.priority, schedule.max_attempts) == (
        "cleanup", "maintenance", 3, 2,
    )  # fmt: skip
    assert schedule.args == {"days": 30} and schedule.missed == "latest"
    assert cleanup.name == "cleanup"  # the decorator hands the task back unchanged


def test_schedule_name_defaults_to_the_task_name() -> None:
    app = pgqueue.App("postgresql://unused/x")

    @app.periodic(cron="@hourly", missed="all", max_catchup=5)
    @app.task(name="reports.hourly")
    def hourly() -> None: ...

    assert app.periodic_schedules["reports.hourly"].max_catchup == 5


def test_schedule_by_task_name() -> None:
    app = pgqueue.App("postgresql://unused/x")
    app.task(name="reports.nightly")(lambda: None)
    schedule = app.schedule("nightly-report", "0 3 * * *", task="reports.nightly")
    assert schedule.queue == "default" and app.periodic_schedules["nightly-report"] is schedule


def test_unknown_task_is_refused_at_declaration() -> None:
    app = pgqueue.App("postgresql://unused/x")
    with pytest.raises(pgqueue.ConfigurationError, match="unknown task 'nope'"):
        app.schedule("x", "* * * * *", task="nope")


def test_duplicate_schedule_name_is_refused() -> None:
    app = pgqueue.App("postgresql://unused/x")
    app.task(name="t")(lambda: None)
    app.schedule("s", "* * * * *", task="t")
    with pytest.raises(pgqueue.ConfigurationError, match="already declared"):
        app.schedule("s", "@daily", task="t")


def test_malformed_cron_is_refused_at_declaration() -> None:
    app = pgqueue.App("postgresql://unused/x")
    with pytest.raises(pgqueue.ConfigurationError, match=r"schedule 'broken'.*invalid cron"):

        @app.periodic(cron="* * *", name="broken")
        @app.task
        def broken() -> None: ...

    assert app.periodic_schedules == {}


def test_bad_options_are_configuration_errors() -> None:
    app = pgqueue.App("postgresql://unused/x")

    @app.task
    def job(n: int) -> None: ...

    with pytest.raises(pgqueue.ConfigurationError, match="missed must be"):
        app.schedule("a", "* * * * *", task="job", args={"n": 1}, missed="some")
    with pytest.raises(pgqueue.ConfigurationError, match="max_catchup"):
        app.schedule("b", "* * * * *", task="job", args={"n": 1}, missed="all", max_catchup=0)
    with pytest.raises(pgqueue.ConfigurationError, match="arguments do not match"):
        app.schedule("c", "* * * * *", task="job", args={"m": 1})


def test_periodic_below_task_is_refused() -> None:
    app = pgqueue.App("postgresql://unused/x")
    with pytest.raises(pgqueue.ConfigurationError, match=r"on top of @app\.task"):
        app.periodic(cron="* * * * *")(lambda: None)  # type: ignore[arg-type]


# --- owners and retirements -------------------------------------------------------------------


def test_app_name_defaults_to_default_and_owns_its_schedules() -> None:
    assert pgqueue.App("postgresql://unused/x").name == "default"
    assert pgqueue.App("postgresql://unused/x", name="billing").name == "billing"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "app name must not be empty"),
        ("   ", "app name must not be empty"),
        ("a\x00b", "must not contain NUL"),
        ("x" * 257, "app name is 257 characters; the limit is 256"),
        (7, "app name must be a string, got int"),
        ("\udc80", "lone surrogate"),
    ],
)
def test_unusable_app_names_are_configuration_errors(name: object, message: str) -> None:
    with pytest.raises(pgqueue.ConfigurationError, match=message):
        pgqueue.App("postgresql://unused/x", name=name)  # type: ignore[arg-type]


def test_a_schedule_cannot_be_declared_and_retired_at_once() -> None:
    app = pgqueue.App("postgresql://unused/x")
    app.task(name="t")(lambda: None)
    app.schedule("s", "* * * * *", task="t")
    with pytest.raises(pgqueue.ConfigurationError, match="'s' is both declared and retired"):
        app.retire_schedule("s")
    app.retire_schedule("old")
    with pytest.raises(pgqueue.ConfigurationError, match="'old' is both declared and retired"):
        app.schedule("old", "* * * * *", task="t")
    assert app.retired_schedules == {"old"} and set(app.periodic_schedules) == {"s"}


@pytest.mark.parametrize("name", ["", "a\x00", "x" * 257, None])
def test_retiring_an_unusable_name_is_a_configuration_error(name: object) -> None:
    app = pgqueue.App("postgresql://unused/x")
    with pytest.raises(pgqueue.ConfigurationError, match="retire_schedule: schedule name"):
        app.retire_schedule(name)  # type: ignore[arg-type]
    assert app.retired_schedules == set()
