"""``pgqueue schedules``: list periodic schedules, pause and resume them.

Kept apart from ``cli.py`` (which adds it with ``main.add_command``) and free of imports from it,
so that either module can be imported first. Works from the database alone: no ``--app`` needed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import click
import psycopg

from . import db
from .errors import DatabaseUnavailableError, PgQueueError
from .schedules import next_tick
from .sql import queries

F = TypeVar("F", bound=Callable[..., Any])

HEADERS = ("Name", "Cron (UTC)", "Task", "Queue", "Next run", "Last run")


def _errors(func: F) -> F:
    """One clear line and a non-zero exit instead of a traceback (2: database unreachable)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except DatabaseUnavailableError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except PgQueueError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except psycopg.errors.UndefinedTable:
            click.echo(
                "error: pgqueue's schedule table is missing: run `pgqueue migrate` first", err=True
            )
            sys.exit(1)
        except psycopg.OperationalError as exc:
            click.echo(f"error: database error: {str(exc).strip().splitlines()[-1]}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def _db_options(func: F) -> F:
    func = click.option("--schema", default=None, help="PostgreSQL schema (default: public).")(func)
    func = click.option(
        "--dsn",
        envvar="PGQUEUE_DSN",
        help="PostgreSQL DSN (default: $PGQUEUE_DSN, else $DATABASE_URL).",
    )(func)
    return func


@dataclass(frozen=True)
class _Target:
    dsn: str | None
    schema: str | None

    def resolve(self, dsn: str | None, schema: str | None) -> tuple[str, str]:
        """Options after the subcommand win over those given to the group."""
        return db.resolve_dsn(dsn or self.dsn), db.validate_schema(
            schema or self.schema or "public"
        )


def _connect(url: str) -> psycopg.Connection[tuple[Any, ...]]:
    return cast("psycopg.Connection[tuple[Any, ...]]", db.connect(url))


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "—"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned columns, as ``pgqueue status`` prints them."""
    table = [HEADERS, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADERS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


@click.group(invoke_without_command=True)
@_db_options
@click.pass_context
@_errors
def schedules_command(ctx: click.Context, dsn: str | None, schema: str | None) -> None:
    """List periodic schedules (times in UTC); `pause NAME` / `resume NAME` steer one."""
    ctx.obj = _Target(dsn, schema)
    if ctx.invoked_subcommand is not None:
        return
    url, schema_name = ctx.obj.resolve(None, None)
    q = queries(schema_name)
    with _connect(url) as conn:
        rows = conn.execute(q.list_schedules).fetchall()
    if not rows:
        click.echo("No schedules")
        return
    lines = []
    for name, cron, task, queue, next_run_at, last_run_at, _job, enabled, paused, *_ in rows:
        if not enabled:
            upcoming = "disabled (not declared)"
        elif paused:
            upcoming = "paused"
        else:
            upcoming = _when(next_run_at)
        lines.append((str(name), str(cron), str(task), str(queue), upcoming, _when(last_run_at)))
    click.echo(format_table(lines))


@schedules_command.command("pause")
@click.argument("name")
@_db_options
@click.pass_obj
@_errors
def pause_command(target: _Target, name: str, dsn: str | None, schema: str | None) -> None:
    """Stop NAME from firing until `resume` (survives worker restarts and re-syncs)."""
    url, schema_name = target.resolve(dsn, schema)
    with _connect(url) as conn:
        found = conn.execute(queries(schema_name).pause_schedule, {"name": name}).fetchone()
    if found is None:
        click.echo(f"error: no schedule named {name!r}", err=True)
        sys.exit(1)
    click.echo(f"schedule {name!r} paused")


@schedules_command.command("resume")
@click.argument("name")
@_db_options
@click.pass_obj
@_errors
def resume_command(target: _Target, name: str, dsn: str | None, schema: str | None) -> None:
    """Let NAME fire again, from its next future tick (ticks inside the pause are skipped)."""
    url, schema_name = target.resolve(dsn, schema)
    q = queries(schema_name)
    with _connect(url) as conn, conn.transaction():
        row = conn.execute(q.lock_schedule, {"name": name}).fetchone()
        if row is None:
            click.echo(f"error: no schedule named {name!r}", err=True)
            sys.exit(1)
        cron, paused, db_now = row
        if paused:
            conn.execute(
                q.resume_schedule, {"name": name, "next_run_at": next_tick(str(cron), db_now)}
            )
    click.echo(f"schedule {name!r} resumed" if paused else f"schedule {name!r} was not paused")
