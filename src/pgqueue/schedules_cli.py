"""``pgqueue schedules``: list periodic schedules, pause, resume, prune and transfer them.

Kept apart from ``cli.py`` (which adds it with ``main.add_command``) and free of module-level
imports from it, so that either module can be imported first. Works from the database alone,
except ``prune``, which needs the app's code to know what it still declares (``--app``).
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
from .errors import ConfigurationError, DatabaseUnavailableError, PgQueueError
from .schedules import check_app_name, next_tick
from .sql import queries

F = TypeVar("F", bound=Callable[..., Any])

HEADERS = ("Name", "App", "Cron (UTC)", "Task", "Queue", "Next run", "Last run")


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
        except psycopg.errors.UndefinedColumn:
            click.echo(
                "error: pgqueue's schedule table is out of date: run `pgqueue migrate` first",
                err=True,
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
    """List periodic schedules with their owning app (times in UTC); `pause NAME` / `resume NAME`
    steer one, `prune --app` retires an app's undeclared ones, `transfer` renames an owner."""
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
    for name, app, cron, task, queue, next_run_at, last_run, _job, enabled, paused, *_ in rows:
        if not enabled:
            upcoming = "retired"
        elif paused:
            upcoming = "paused"
        else:
            upcoming = _when(next_run_at)
        lines.append(
            (str(name), str(app), str(cron), str(task), str(queue), upcoming, _when(last_run))
        )
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


@schedules_command.command("prune")
@click.option(
    "--app", "app_spec", required=True, metavar="MODULE:APP", help="The app, as for `worker`."
)
@click.option("--dry-run", is_flag=True, help="Only print what would be retired.")
@_db_options
@click.pass_obj
@_errors
def prune_command(
    target: _Target, app_spec: str, dry_run: bool, dsn: str | None, schema: str | None
) -> None:
    """Retire the schedules owned by the app's name that its code no longer declares (they stop
    firing; rows and history stay; declaring one again brings it back). Other apps' schedules
    are never touched. Run it once no worker of an older version that declares them is left."""
    from .cli import load_app  # deferred: cli.py imports this module

    app = load_app(app_spec)
    given = dsn or target.dsn
    if given:
        app.dsn = given
    wanted = schema or target.schema
    if wanted is not None and db.validate_schema(wanted) != app.schema:
        raise ConfigurationError(f"--schema {wanted!r} differs from the app's {app.schema!r}")
    try:
        names = app.prune_schedules(dry_run=dry_run)
    finally:
        app.close()
    verb = "would retire" if dry_run else "retired"
    for name in names:
        click.echo(f"{verb} schedule {name!r} of app {app.name!r}")
    if not names:
        click.echo(f"app {app.name!r} declares every live schedule it owns: nothing to prune")


@schedules_command.command("transfer")
@click.argument("old_app")
@click.argument("new_app")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@_db_options
@click.pass_obj
@_errors
def transfer_command(
    target: _Target,
    old_app: str,
    new_app: str,
    names: tuple[str, ...],
    dsn: str | None,
    schema: str | None,
) -> None:
    """Give the schedules owned by app OLD_APP (all, or only the NAMEs) to app NEW_APP, for an
    App whose name= changed or is set for the first time (schedules from before owners belong to
    `default`): run it before deploying. Ticks, pauses and history are kept."""
    old_app, new_app = check_app_name(old_app), check_app_name(new_app)
    if old_app == new_app:
        raise ConfigurationError(f"OLD_APP and NEW_APP are both {old_app!r}: nothing to transfer")
    url, schema_name = target.resolve(dsn, schema)
    q = queries(schema_name)
    params = {"from_app": old_app, "to_app": new_app, "names": list(names) or None}
    with _connect(url) as conn, conn.transaction():
        conn.execute(q.lock_schedule_sync, {"schema": schema_name})
        moved = sorted(str(row[0]) for row in conn.execute(q.transfer_schedules, params))
        missing = sorted(set(names) - set(moved))
        if missing:  # raised inside the transaction: nothing is transferred
            raise ConfigurationError(
                f"no schedule named {', '.join(map(repr, missing))} belongs to app {old_app!r}; "
                "nothing transferred"
            )
    if not moved:
        click.echo(f"error: no schedules belong to app {old_app!r}", err=True)
        sys.exit(1)
    for name in moved:
        click.echo(f"schedule {name!r}: app {old_app!r} -> {new_app!r}")
