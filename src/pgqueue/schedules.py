"""Periodic schedules: the declaration, cron parsing, the tick arithmetic and retirement.

Cron expressions are parsed by cronsim (a maintained library); this module only maps the
``@aliases`` to their five-field forms and turns library errors into ``ConfigurationError`` at
declaration time. Every function that decides a tick takes the reference time as an argument:
the scheduler passes the database clock (``now()``), never the local one.

A schedule belongs to the app that declared it (``App(name=...)``). Nothing stops a schedule
implicitly: it is retired only by its own app, on request (``retire``, applied at the next worker
start, or ``prune``), because another service or another version of the same app may still
declare what this code does not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

from cronsim import CronSim, CronSimError

from . import producer
from .errors import ConfigurationError, InvalidJobError

if TYPE_CHECKING:
    import psycopg

    from .app import App
    from .tasks import Task

MissedPolicy = Literal["latest", "all"]
DEFAULT_MAX_CATCHUP = 100
MAX_NAME_LENGTH = 256  # schedule and app names (the columns check the same bound)
DEFAULT_APP_NAME = "default"  # App(name=...)'s default; schedules from before owners are its

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

# Any fixed instant works for validation; cronsim only needs a starting point.
_PROBE = datetime(2000, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)


def check_app_name(name: object) -> str:
    """An app's name as its schedules record it: a ConfigurationError when unusable."""
    try:
        return producer.check_name("app", name, MAX_NAME_LENGTH)
    except InvalidJobError as exc:
        raise ConfigurationError(str(exc)) from None


def normalize_cron(expr: object) -> str:
    """The expression as stored: whitespace collapsed, aliases lower-cased, checked to parse
    and to fire at least once (cronsim gives up after 50 years without a match)."""
    if not isinstance(expr, str):
        raise ConfigurationError(f"cron must be a string, got {type(expr).__name__}")
    text = " ".join(expr.split())
    if text.startswith("@"):
        text = text.lower()
        if text not in ALIASES:
            raise ConfigurationError(
                f"unknown cron alias {expr!r} (known: {', '.join(sorted(ALIASES))})"
            )
        return text
    fields = len(text.split())
    if fields not in (5, 6):
        raise ConfigurationError(
            f"invalid cron expression {expr!r}: expected 5 fields (minute hour day month "
            f"weekday) or 6 with a leading seconds field, got {fields}"
        )
    try:
        next(CronSim(text, _PROBE))
    except CronSimError as exc:
        raise ConfigurationError(f"invalid cron expression {expr!r}: {exc}") from None
    except StopIteration:
        raise ConfigurationError(f"cron expression {expr!r} never fires") from None
    return text


def _expand(cron: str) -> str:
    return ALIASES.get(cron, cron)


def _utc(when: datetime) -> datetime:
    """Cron is always UTC: a timestamp from a session in another TimeZone is converted first,
    so cronsim never applies its DST rules."""
    if when.tzinfo is None:
        raise ValueError("tick arithmetic needs timezone-aware datetimes")
    return when.astimezone(UTC)


def next_tick(cron: str, after: datetime) -> datetime:
    """The first tick strictly after ``after``."""
    return next(CronSim(_expand(cron), _utc(after)))


def due_ticks(
    cron: str,
    next_run_at: datetime,
    now: datetime,
    missed: MissedPolicy = "latest",
    max_catchup: int = DEFAULT_MAX_CATCHUP,
) -> tuple[list[datetime], datetime]:
    """The ticks to fire now, oldest first, and the schedule's next ``next_run_at``.

    Due ticks are those in [next_run_at, now]. ``latest`` fires only the newest of them;
    ``all`` fires the newest ``max_catchup`` (older ones are skipped). Either way the schedule
    continues from the first tick after ``now``, so a long outage never causes a burst beyond
    the bound. Walking backwards from ``now`` keeps the cost O(bound) however long the gap.
    """
    next_run_at, now = _utc(next_run_at), _utc(now)
    if next_run_at > now:
        return [], next_run_at
    limit = 1 if missed == "latest" else max_catchup
    ticks: list[datetime] = []
    # Starting one second past now (microseconds dropped) makes a tick at exactly now count.
    start = now.replace(microsecond=0) + _SECOND
    for tick in CronSim(_expand(cron), start, reverse=True):
        if tick < next_run_at or len(ticks) >= limit:
            break
        ticks.append(tick)
    if not ticks:
        # next_run_at is off the cron grid (set by hand): it is still a due tick.
        ticks.append(next_run_at)
    ticks.reverse()
    return ticks, next_tick(cron, now)


@dataclass(frozen=True, slots=True)
class Schedule:
    """A periodic schedule as declared in code; synced to ``pgqueue_schedules`` by name."""

    name: str
    cron: str
    task: str
    queue: str
    args_json: str
    priority: int
    max_attempts: int
    missed: MissedPolicy
    max_catchup: int

    @property
    def args(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.args_json)
        return value


def declare(
    app: App,
    task: Task[Any, Any],
    *,
    cron: str,
    name: str | None,
    queue: str | None,
    args: Mapping[str, Any] | None,
    priority: int | None,
    max_attempts: int | None,
    missed: str,
    max_catchup: int,
) -> Schedule:
    """Validate a declaration and register it on ``app``; every mistake is raised here, at
    import time, rather than discovered by a worker later."""
    schedule_name = name if name is not None else task.name
    try:
        schedule_name = producer.check_name("schedule", schedule_name, MAX_NAME_LENGTH)
        if missed not in get_args(MissedPolicy):
            raise ConfigurationError(f"missed must be 'latest' or 'all', got {missed!r}")
        catchup = producer.check_int("max_catchup", max_catchup, 1)
        schedule = Schedule(
            name=schedule_name,
            cron=normalize_cron(cron),
            task=task.name,
            queue=producer.check_name(
                "queue",
                queue if queue is not None else task.options.queue,
                producer.MAX_QUEUE_LENGTH,
            ),
            args_json=producer.serialize_args(args, app.max_payload_bytes),
            priority=producer.check_int(
                "priority", task.options.priority if priority is None else priority, -(2**31 - 1)
            ),
            max_attempts=producer.check_int(
                "max_attempts",
                task.options.max_attempts if max_attempts is None else max_attempts,
                1,
            ),
            missed=missed,  # type: ignore[arg-type]  # checked against MissedPolicy above
            max_catchup=catchup,
        )
        task.check_args(dict(args or {}))
    except InvalidJobError as exc:
        raise ConfigurationError(f"schedule {schedule_name!r}: {exc}") from None
    except ConfigurationError as exc:
        raise ConfigurationError(f"schedule {schedule_name!r}: {exc}") from None
    if schedule_name in app.periodic_schedules:
        raise ConfigurationError(
            f"schedule name {schedule_name!r} is already declared; pass name=... to tell them apart"
        )
    if schedule_name in app.retired_schedules:
        raise ConfigurationError(
            f"schedule {schedule_name!r} is both declared and retired; keep only one of the two"
        )
    app.periodic_schedules[schedule_name] = schedule
    return schedule


def retire(app: App, name: object) -> None:
    """Record that ``app`` retires the schedule ``name``: each worker applies it when it starts
    (a deploy retires a schedule without running a command). Checked at import time, like a
    declaration."""
    try:
        checked = producer.check_name("schedule", name, MAX_NAME_LENGTH)
    except InvalidJobError as exc:
        raise ConfigurationError(f"retire_schedule: {exc}") from None
    if checked in app.periodic_schedules:
        raise ConfigurationError(
            f"schedule {checked!r} is both declared and retired; keep only one of the two"
        )
    app.retired_schedules.add(checked)


def prune(conn: psycopg.Connection[Any], app: App, *, dry_run: bool) -> list[str]:
    """Retire the live schedules owned by ``app.name`` that its code no longer declares, and
    return their names (with ``dry_run``, only return them). Other apps' rows are never
    touched: only their own app may retire them."""
    params = {"app": app.name, "declared": sorted(app._cluster_schedules())}
    with conn.transaction():
        conn.execute(app.q.lock_schedule_sync, {"schema": app.schema})
        names = [str(row[0]) for row in conn.execute(app.q.undeclared_schedules, params)]
        if names and not dry_run:
            conn.execute(app.q.retire_schedules, {"app": app.name, "names": names})
    return names
