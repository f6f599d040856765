"""The ``pgqueue`` command. Every command takes ``--dsn`` (else $PGQUEUE_DSN, else $DATABASE_URL)
and ``--schema``; an unreachable database is one line on stderr and exit status 2. Every option
can also come from the environment (``PGQUEUE_WORKER_CONCURRENCY``; see environment.py)."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from typing import Any, TypeVar

import click
import psycopg

from . import __version__, environment, limits, queues
from .app import App
from .bench.cli import bench_command
from .db import validate_schema
from .embedded import BACKENDS
from .errors import ConfigurationError, DatabaseUnavailableError, PgQueueError
from .jobs import Attempt, CancelResult
from .logcontext import JobLogFilter
from .migrate import DEFAULT_LOCK_TIMEOUT, DEFAULT_TIMEOUT, migration_script
from .operations import STATUSES as JOB_STATUSES
from .operations import parse_duration
from .producer import MAX_NESTING
from .schedules_cli import schedules_command

F = TypeVar("F", bound=Callable[..., Any])
#: Job ids are bigint: a bigger number is a typing mistake, not a job that does not exist.
JOB_ID = click.IntRange(1, 2**63 - 1)


def friendly_errors(func: F) -> F:
    """Turn pgqueue's and psycopg's errors into one clear line and a non-zero exit."""

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
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
            click.echo(
                "error: pgqueue's tables are missing or older than this pgqueue: run "
                "`pgqueue migrate` first",
                err=True,
            )
            sys.exit(1)
        except psycopg.OperationalError as exc:
            click.echo(f"error: database error: {str(exc).strip().splitlines()[-1]}", err=True)
            sys.exit(2)
        except psycopg.Error as exc:  # e.g. a row written by an older pgqueue that reads badly
            first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
            click.echo(f"error: database error: {first[0]}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@dataclass
class GroupDatabase:
    """``--dsn``/``--schema`` given to a command group (``queues``, ``tasks``) rather than to
    its subcommand: they apply to the subcommand as if given to it."""

    dsn: str | None
    schema: str | None


COMMAND_LINE = click.core.ParameterSource.COMMANDLINE


def group_database(ctx: click.Context, dsn: str | None, schema: str) -> None:
    source = ctx.get_parameter_source
    ctx.obj = GroupDatabase(
        dsn if source("dsn") is COMMAND_LINE else None,
        schema if source("schema") is COMMAND_LINE else None,
    )


def db_options(func: F) -> F:
    func = click.option("--schema", default="public", show_default=True, help="PostgreSQL schema.")(
        func
    )
    func = click.option(
        "--dsn",
        envvar="PGQUEUE_DSN",
        help="PostgreSQL DSN (default: $PGQUEUE_DSN, else $DATABASE_URL).",
    )(func)
    return func


def load_app(spec: str) -> App:
    """``module.path:attribute`` → the App object it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app must look like 'package.module:app', got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from None
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise ConfigurationError(f"{spec!r} is not a pgqueue.App (got {type(app).__name__})")
    return app


def make_app(
    dsn: str | None, schema: str, app_spec: str | None = None, *, interactive: bool = True
) -> App:
    # Given before a subcommand (`pgqueue queues --dsn URL pause NAME`), the group's apply
    # unless the subcommand was given its own.
    ctx = click.get_current_context()
    given = ctx.find_object(GroupDatabase)
    if given is not None:
        if given.dsn is not None and ctx.get_parameter_source("dsn") is not COMMAND_LINE:
            dsn = given.dsn
        if given.schema is not None and ctx.get_parameter_source("schema") is not COMMAND_LINE:
            schema = given.schema
    app = _resolve_app(dsn, schema, app_spec)
    if interactive:
        # A command fails at once when PostgreSQL cannot be reached, instead of retrying for
        # the app's reconnect_timeout: someone is watching, and can run it again. (Not the
        # worker's: its handlers' enqueues ride out a failover like any producer's.)
        app.reconnect_timeout = 0.0
    # The producer pool's threads must be stopped when the command ends, not left to the
    # garbage collector (whose ConnectionPool.__del__ may run on a pool thread and fail).
    click.get_current_context().call_on_close(app.close)
    return app


def _resolve_app(dsn: str | None, schema: str, app_spec: str | None) -> App:
    if app_spec:
        app = load_app(app_spec)
        if dsn:
            app.dsn = dsn
        if schema != "public" and app.schema != schema:
            raise ConfigurationError(f"--schema {schema!r} differs from the app's {app.schema!r}")
        app.dsn  # noqa: B018 - resolve now for a clear error
        return app
    app = App(dsn, schema=schema)
    app.dsn  # noqa: B018
    return app


@click.group(cls=environment.Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="pgqueue")
@click.pass_context
def main(ctx: click.Context) -> None:
    """pgqueue: a job queue for Python where PostgreSQL is the whole broker."""
    if ctx.invoked_subcommand != "worker":  # the worker configures its own (--log-level)
        # pgqueue's logger has a NullHandler (a library's convention), which silences Python's
        # last-resort stderr output: a command's warnings (a migration waiting for a lock, a
        # dashboard that cannot read the database) are shown here instead.
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_LOCK_TIMEOUT,
    show_default=True,
    help="Seconds a step may wait for a lock before it backs off and tries again: about the "
    "longest an enqueue, claim or ack waits behind the migration.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds after which a step that still cannot take its locks fails, naming the "
    "sessions that hold them (work under way is never interrupted).",
)
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the migrations as one SQL script for `psql -v ON_ERROR_STOP=1 -f` (or your own "
    "migration tool) instead of applying them; needs no database.",
)
@click.option(
    "--from",
    "from_version",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="With --sql: start at this version (e.g. 12; default: the first).",
)
@click.option(
    "--to",
    "to_version",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="With --sql: end at this version, included (default: the latest).",
)
@db_options
@friendly_errors
def migrate(
    dsn: str | None,
    schema: str,
    lock_timeout: float,
    timeout: float,
    as_sql: bool,
    from_version: int | None,
    to_version: int | None,
) -> None:
    """Create or upgrade pgqueue's tables, safely on a live system: each migration in its own
    transaction, lock waits bounded and retried (idempotent, safe to run concurrently). With
    --sql, print them instead, for a schema managed by Alembic, Django, Flyway or a DBA."""
    if as_sql:
        click.echo(
            migration_script(schema, from_version=from_version, to_version=to_version), nl=False
        )
        return
    if from_version is not None or to_version is not None:
        raise click.UsageError("--from and --to go with --sql (migrate applies what is missing)")
    applied = make_app(dsn, schema).migrate(lock_timeout=lock_timeout, timeout=timeout)
    if applied:
        click.echo(f"applied migrations: {', '.join(f'{v:04d}' for v in applied)}")
    else:
        click.echo("schema is up to date")


@main.command()
@click.argument("task")
@click.option("--args", "args_json", default="{}", help="Keyword arguments as a JSON object.")
@click.option("--queue", default=None, help="Queue (default: the task's, else 'default').")
@click.option("--delay", type=float, default=None, help="Seconds to wait before running.")
@click.option("--priority", type=int, default=None, help="Higher runs first.")
@click.option("--max-attempts", type=int, default=None)
@click.option(
    "--unique-key",
    default=None,
    help="Make the job unique under this key: if a job of TASK holds it, print that job's id "
    "(with '(duplicate)') and write nothing.",
)
@click.option("--app", "app_spec", default=None, help="module:app, to check the task exists.")
@db_options
@friendly_errors
def enqueue(
    task: str,
    args_json: str,
    queue: str | None,
    delay: float | None,
    priority: int | None,
    max_attempts: int | None,
    unique_key: str | None,
    app_spec: str | None,
    dsn: str | None,
    schema: str,
) -> None:
    """Queue a job for TASK and print its id (a unique task's duplicate: the holding job's id,
    followed by "(duplicate)")."""
    try:
        args = json.loads(args_json)
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--args") from None
    except RecursionError:
        raise click.BadParameter(
            f"nested too deeply (the limit is {MAX_NESTING} levels)", param_hint="--args"
        ) from None
    app = make_app(dsn, schema, app_spec)
    job_id = app.enqueue(
        task,
        args,
        queue=queue,
        delay=delay,
        priority=priority,
        max_attempts=max_attempts,
        allow_unknown=app_spec is None,
        unique_key=unique_key,
    )
    click.echo(f"{job_id} (duplicate)" if job_id.duplicate else job_id)


def filter_options(func: F) -> F:
    """--task, --queue, --status (repeatable), --since, --older-than: which jobs."""
    for option in reversed([
        click.option("--task", default=None, help="Only jobs of this task."),
        click.option("--queue", default=None, help="Only jobs of this queue."),
        click.option("--status", "statuses", multiple=True, type=click.Choice(JOB_STATUSES),
                     help="Only jobs in this status (repeatable)."),
        click.option("--since", default=None, metavar="DURATION",
                     help="Only jobs that finished (or were enqueued) within it: 1h, 7d, 90s."),
        click.option("--older-than", default=None, metavar="DURATION",
                     help="Only jobs that finished (or were enqueued) longer ago than it."),
    ]):  # fmt: skip
        func = option(func)
    return func


def _filter(
    task: str | None, queue: str | None, statuses: tuple[str, ...], since: str | None,
    older_than: str | None,
) -> dict[str, Any]:  # fmt: skip
    return {"task": task, "queue": queue, "status": statuses or None, "since": since,
            "older_than": older_than}  # fmt: skip


def _bulk_or_one(job_id: int | None, filters: dict[str, Any], command: str) -> bool:
    """True for a bulk action; exits with a usage error when both or neither are given."""
    named = any(v for v in filters.values())
    if job_id is not None and named:
        raise click.UsageError(f"give a job id or filters to `pgqueue {command}`, not both")
    if job_id is None and not named:
        raise click.UsageError("give a job id, or filters (--task, --status, ...) for many")
    return job_id is None


def _report_bulk(action: str, count: int, dry_run: bool) -> None:
    noun = "job" if count == 1 else "jobs"
    click.echo(f"{count} {noun} would be {action}" if dry_run else f"{count} {noun} {action}")


@main.command()
@click.argument("job_id", type=JOB_ID, required=False)
@filter_options
@click.option("--dry-run", is_flag=True, help="Only count the jobs the filters match.")
@db_options
@friendly_errors
def requeue(
    job_id: int | None, task: str | None, queue: str | None, statuses: tuple[str, ...],
    since: str | None, older_than: str | None, dry_run: bool, dsn: str | None, schema: str,
) -> None:  # fmt: skip
    """Run a dead or cancelled job again, or every dead one (--status cancelled: cancelled)
    that the filters match, in batches, recorded in `pgqueue audit`."""
    filters = _filter(task, queue, statuses, since, older_than)
    app = make_app(dsn, schema)
    if _bulk_or_one(job_id, filters, "requeue"):
        _report_bulk("requeued", app.requeue_jobs(**filters, dry_run=dry_run), dry_run)
        return
    assert job_id is not None
    if not app.requeue(job_id):
        click.echo(f"error: job {job_id} does not exist or is not dead or cancelled", err=True)
        sys.exit(1)
    click.echo(f"job {job_id} requeued")


@main.command()
@click.argument("job_id", type=JOB_ID, required=False)
@filter_options
@click.option("--dry-run", is_flag=True, help="Only count the jobs the filters match.")
@db_options
@friendly_errors
def cancel(
    job_id: int | None, task: str | None, queue: str | None, statuses: tuple[str, ...],
    since: str | None, older_than: str | None, dry_run: bool, dsn: str | None, schema: str,
) -> None:  # fmt: skip
    """Cancel a job: a waiting one at once, a running one by asking its worker to stop it (it
    then ends cancelled, never retried). With filters, every waiting job they match (add
    --status running for running ones), in batches, recorded in `pgqueue audit`."""
    filters = _filter(task, queue, statuses, since, older_than)
    app = make_app(dsn, schema)
    if _bulk_or_one(job_id, filters, "cancel"):
        _report_bulk("cancelled", app.cancel_jobs(**filters, dry_run=dry_run), dry_run)
        return
    assert job_id is not None
    result = app.cancel(job_id)
    if result is CancelResult.FINISHED:
        click.echo(f"error: job {job_id} had already finished", err=True)
        sys.exit(1)
    if result is CancelResult.REQUESTED:
        click.echo(f"job {job_id}: cancel requested (it is running; its worker stops it)")
    else:
        click.echo(f"job {job_id} cancelled")


@main.command("retry-now")
@click.argument("job_id", type=JOB_ID)
@db_options
@friendly_errors
def retry_now(job_id: int, dsn: str | None, schema: str) -> None:
    """Run a retrying (or delayed) job now instead of at its run_at."""
    if not make_app(dsn, schema).retry_now(job_id):
        click.echo(f"error: job {job_id} is not waiting (queued or retrying)", err=True)
        sys.exit(1)
    click.echo(f"job {job_id} is due now")


@main.command()
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    help="Only jobs that finished longer ago than it: 7d, 12h.",
)
@click.option("--task", default=None, help="Only jobs of this task.")
@click.option("--queue", default=None, help="Only jobs of this queue.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(("succeeded", "dead", "cancelled")),
    help="Finished status to delete (repeatable; default succeeded).",
)
@click.option("--dry-run", is_flag=True, help="Only count the jobs that would go.")
@db_options
@friendly_errors
def purge(
    older_than: str, task: str | None, queue: str | None, statuses: tuple[str, ...],
    dry_run: bool, dsn: str | None, schema: str,
) -> None:  # fmt: skip
    """Delete finished jobs in batches (never a long lock), recorded in `pgqueue audit`."""
    count = make_app(dsn, schema).purge_jobs(
        older_than=older_than, task=task, queue=queue, status=statuses or None, dry_run=dry_run
    )
    _report_bulk("deleted", count, dry_run)


@main.command()
@filter_options
@click.option("--limit", type=click.IntRange(1, 10_000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@db_options
@friendly_errors
def jobs(
    task: str | None, queue: str | None, statuses: tuple[str, ...], since: str | None,
    older_than: str | None, limit: int, as_json: bool, dsn: str | None, schema: str,
) -> None:  # fmt: skip
    """Find jobs, newest first: a table, or JSON lines with --json."""
    found = make_app(dsn, schema).find_jobs(
        **_filter(task, queue, statuses, since, older_than), limit=limit
    )
    if as_json:
        for j in found:
            click.echo(json.dumps({k: getattr(j, k) for k in j.__dataclass_fields__}, default=str))
        return
    if not found:
        click.echo("no jobs match")
        return
    click.echo(
        f"{'id':>10}  {'status':<10} {'attempts':>8}  {'task':<24} {'queue':<16} when / error"
    )
    for j in found:
        when = j.finished_at or j.created_at
        error = f"  {j.error[:80]}" if j.error else ""
        click.echo(
            f"{j.id:>10}  {j.status:<10} {f'{j.attempts}/{j.max_attempts}':>8}  "
            f"{j.task[:24]:<24} {j.queue[:16]:<16} {when.astimezone(UTC):%Y-%m-%d %H:%M:%S}"
            f"{error}"
        )


@main.command()
@click.option("--limit", type=click.IntRange(1, 10_000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@db_options
@friendly_errors
def audit(limit: int, as_json: bool, dsn: str | None, schema: str) -> None:
    """The newest bulk actions (requeue, cancel, purge by filter): who, when, what, how many."""
    entries = make_app(dsn, schema).audit_log(limit)
    if as_json:
        for e in entries:
            click.echo(json.dumps({k: getattr(e, k) for k in e.__dataclass_fields__}, default=str))
        return
    if not entries:
        click.echo("no bulk actions yet")
        return
    for e in entries:
        state = "dry run" if e.dry_run else ("done" if e.finished_at else "interrupted")
        click.echo(
            f"{e.at.astimezone(UTC):%Y-%m-%d %H:%M:%S}  {e.action:<8} {e.matched:>8}  {state:<11} "
            f"{json.dumps(e.filter, sort_keys=True)}  by {e.actor}"
        )


@main.command()
@click.argument("job_id", type=JOB_ID)
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
@db_options
@friendly_errors
def job(job_id: int, as_json: bool, dsn: str | None, schema: str) -> None:
    """Show one job, with every attempt it made."""
    app = make_app(dsn, schema)
    found = app.get_job(job_id)
    if found is None:
        click.echo(f"error: job {job_id} does not exist", err=True)
        sys.exit(1)
    fields = {k: getattr(found, k) for k in found.__dataclass_fields__}
    history = app.job_attempts(job_id)
    if as_json:
        fields["attempt_history"] = [
            {k: getattr(a, k) for k in a.__dataclass_fields__} for a in history
        ]
        click.echo(json.dumps(fields, default=str, indent=2, ensure_ascii=False))
        return
    for key, value in fields.items():
        if value is None:
            continue
        if key == "args" or key == "result":
            value = json.dumps(value, ensure_ascii=False)
        text = str(value)
        if "\n" in text:
            click.echo(f"{key}:")
            click.echo("  " + text.replace("\n", "\n  "))
        else:
            click.echo(f"{key}: {text}")
    if history:
        click.echo("attempt history:")
    for attempt in history:
        echo_attempt(attempt)


def echo_attempt(attempt: Attempt) -> None:
    """One attempt: number, outcome, when it started and how long it ran, its worker; then its
    error, indented."""
    began = attempt.started_at or attempt.claimed_at
    when = f"{began.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC" if began else "not started"
    line = f"  #{attempt.number} {attempt.outcome:<13} {when}"
    if began and attempt.finished_at:
        line += f"  ran {(attempt.finished_at - began).total_seconds():.3f} s"
    if attempt.worker_id:
        line += f"  worker {str(attempt.worker_id)[:8]}"
    click.echo(line)
    if attempt.error:
        click.echo("      " + attempt.error.rstrip().replace("\n", "\n      "))


STATUSES = ("queued", "running", "retrying", "succeeded", "dead", "cancelled", "blocked")


def echo_counts(counts: list[tuple[str, str, int]], states: dict[str, str] | None = None) -> None:
    """Jobs per queue and status, one line per queue; with ``states``, queues without jobs too,
    and a last column with each queue's operator state (paused since when, limit, rate)."""
    table: dict[str, dict[str, int]] = {}
    for queue, state, count in counts:
        table.setdefault(queue, {})[state] = count
    for queue in states or {}:
        table.setdefault(queue, {})
    width = max(5, *(len(q) for q in table))
    header = "queue".ljust(width) + "".join(s.rjust(11) for s in STATUSES)
    click.echo(header if states is None else header + "  state")
    for queue, row in sorted(table.items()):
        line = queue.ljust(width) + "".join(str(row.get(s, 0)).rjust(11) for s in STATUSES)
        if states is not None and states.get(queue):
            line += "  " + states[queue]
        click.echo(line)


def queue_states(app: App) -> dict[str, str]:
    """Each queue with operator state, as the last column of `queues list`."""
    with app.connection() as conn:
        since = dict(queues.paused(conn, app.q))
    states: dict[str, str] = {}
    for setting in app.queue_limits():
        parts = []
        if setting.name in since:
            parts.append(
                f"paused since {since[setting.name].astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
            )
        if setting.limit is not None:
            parts.append(f"limit {setting.limit}")
        if setting.rate is not None:
            parts.append(f"rate {setting.rate}")
        if parts:
            states[setting.name] = "; ".join(parts)
    return states


@main.command()
@db_options
@friendly_errors
def status(dsn: str | None, schema: str) -> None:
    """Job counts per queue and status."""
    counts = make_app(dsn, schema).status_counts()
    if not counts:
        click.echo("no jobs")
        return
    echo_counts(counts)


@main.group("queues", invoke_without_command=True)
@db_options
@click.pass_context
def queues_command(ctx: click.Context, dsn: str | None, schema: str) -> None:
    """List queues (alone: as `queues list`), pause and resume them, and set their limits and
    rates (the state is kept in the database)."""
    group_database(ctx, dsn, schema)
    if ctx.invoked_subcommand is None:
        ctx.invoke(queues_list, dsn=dsn, schema=schema)


@queues_command.command("list")
@db_options
@friendly_errors
def queues_list(dsn: str | None, schema: str) -> None:
    """Every queue that has jobs or operator state: its jobs by status, and whether it is
    paused, limited or rate-limited."""
    app = make_app(dsn, schema)
    counts = app.status_counts()
    states = queue_states(app)
    if not counts and not states:
        click.echo("no queues: no jobs, and none paused or limited")
        return
    echo_counts(counts, states)


@queues_command.command("pause")
@click.argument("name")
@db_options
@friendly_errors
def queues_pause(name: str, dsn: str | None, schema: str) -> None:
    """Stop every worker from claiming NAME's jobs until `resume` (running jobs finish; jobs can
    still be enqueued)."""
    if make_app(dsn, schema).pause_queue(name):
        click.echo(f"queue {name!r} paused")
    else:
        click.echo(f"queue {name!r} was already paused")


@queues_command.command("resume")
@click.argument("name")
@db_options
@friendly_errors
def queues_resume(name: str, dsn: str | None, schema: str) -> None:
    """Let workers claim NAME's jobs again; idle workers are woken at once."""
    if make_app(dsn, schema).resume_queue(name):
        click.echo(f"queue {name!r} resumed")
    else:
        click.echo(f"queue {name!r} was not paused")


def _limit_value(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        return limits.check_limit(int(value))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give a whole number of jobs, or 'none'") from None
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None


def _rate_value(value: str) -> limits.Rate | None:
    if value.lower() == "none":
        return None
    try:
        return limits.parse_rate(value)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None


@queues_command.command("limit")
@click.argument("name")
@click.argument("limit", metavar="N|none")
@db_options
@friendly_errors
def queues_limit(name: str, limit: str, dsn: str | None, schema: str) -> None:
    """At most N of NAME's jobs running at once across every worker ('none' removes the
    limit). Workers obey from their next claim, without a restart."""
    value = _limit_value(limit)
    make_app(dsn, schema).limit_queue(name, limit=value)
    click.echo(f"queue {name!r}: " + ("no limit" if value is None else f"limit {value}"))


@queues_command.command("rate")
@click.argument("name")
@click.argument("rate", metavar="RATE|none")
@db_options
@friendly_errors
def queues_rate(name: str, rate: str, dsn: str | None, schema: str) -> None:
    """At most RATE of NAME's jobs started per period across every worker, e.g. 100/m, 5/s,
    10/5m ('none' removes it). Jobs over the rate wait; none fails."""
    value = _rate_value(rate)
    make_app(dsn, schema).limit_queue(name, rate=value)
    click.echo(f"queue {name!r}: " + ("no rate" if value is None else f"rate {value}"))


@main.group("tasks", invoke_without_command=True)
@db_options
@click.pass_context
def tasks_command(ctx: click.Context, dsn: str | None, schema: str) -> None:
    """List task limits and rates (alone: as `tasks list`), and change them at run time (kept
    over the code's values until reset)."""
    group_database(ctx, dsn, schema)
    if ctx.invoked_subcommand is None:
        ctx.invoke(tasks_list, dsn=dsn, schema=schema)


@tasks_command.command("list")
@db_options
@friendly_errors
def tasks_list(dsn: str | None, schema: str) -> None:
    """Every task with a limit or a rate in the database."""
    settings = make_app(dsn, schema).task_limits()
    if not settings:
        click.echo("no task has a limit or a rate")
        return
    width = max(4, *(len(t.name) for t in settings))
    click.echo("task".ljust(width) + "  limit".rjust(8) + "  rate".rjust(12) + "  per key  set by")
    for t in settings:
        click.echo(
            t.name.ljust(width)
            + ("-" if t.limit is None else str(t.limit)).rjust(8)
            + ("-" if t.rate is None else str(t.rate)).rjust(12)
            + ("  yes    " if t.per_key else "  no     ")
            + ("  operator" if t.overridden else "  code")
        )


@tasks_command.command("limit")
@click.argument("name")
@click.argument("limit", metavar="N|none")
@db_options
@friendly_errors
def tasks_limit(name: str, limit: str, dsn: str | None, schema: str) -> None:
    """At most N of task NAME's jobs running at once (per key, if the task declares limit_key);
    'none' removes it. Kept over the code's value until `pgqueue tasks reset NAME`."""
    value = _limit_value(limit)
    make_app(dsn, schema).limit_task(name, limit=value)
    click.echo(f"task {name!r}: " + ("no limit" if value is None else f"limit {value}"))


@tasks_command.command("rate")
@click.argument("name")
@click.argument("rate", metavar="RATE|none")
@db_options
@friendly_errors
def tasks_rate(name: str, rate: str, dsn: str | None, schema: str) -> None:
    """At most RATE of task NAME's jobs started per period (per key, if the task declares
    limit_key), e.g. 100/m; 'none' removes it. Kept over the code's value until reset."""
    value = _rate_value(rate)
    make_app(dsn, schema).limit_task(name, rate=value)
    click.echo(f"task {name!r}: " + ("no rate" if value is None else f"rate {value}"))


@tasks_command.command("reset")
@click.argument("name")
@db_options
@friendly_errors
def tasks_reset(name: str, dsn: str | None, schema: str) -> None:
    """Drop the operator's values for task NAME: the code's apply from the next worker start."""
    if make_app(dsn, schema).reset_task_limits(name):
        click.echo(f"task {name!r}: the code's limit and rate apply from the next worker start")
    else:
        click.echo(f"task {name!r} had no operator's limit or rate")


@main.command()
@click.option("--app", "app_spec", required=True, help="module:app holding your tasks.")
@click.option("--queues", default=None, help="Comma-separated queues (default: all).")
@click.option("--concurrency", type=click.IntRange(min=1), default=10, show_default=True)
@click.option(
    "--prefetch",
    type=click.IntRange(min=0),
    default=None,
    help="Most jobs claimed ahead of free slots (default: the concurrency, at least 1024).",
)
@click.option("--lease", type=float, default=30.0, show_default=True, help="Lease seconds.")
@click.option(
    "--heartbeat-interval", type=float, default=None, help="Seconds between heartbeats [lease/3]."
)
@click.option("--poll-interval", type=float, default=1.0, show_default=True)
@click.option("--grace-period", type=float, default=30.0, show_default=True)
@click.option("--no-listen", is_flag=True, help="Poll only; do not LISTEN for NOTIFY.")
@click.option(
    "--retention",
    default="1d",
    show_default=True,
    metavar="DURATION",
    help="Keep succeeded and cancelled jobs this long (90s, 30m, 12h, 7d; 'none': forever).",
)
@click.option(
    "--dead-retention",
    default="none",
    show_default=True,
    metavar="DURATION",
    help="Keep dead jobs this long ('none': until requeued or deleted).",
)
@click.option(
    "--archive",
    is_flag=True,
    help="Move finished jobs past their retention to pgqueue_jobs_archive instead of deleting "
    "them.",
)
@click.option(
    "--archive-retention",
    default="none",
    show_default=True,
    metavar="DURATION",
    help="With --archive: drop archived jobs this long after they finished, a day at a time.",
)
@click.option(
    "--event-loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="auto: uvloop when installed.",
)
@click.option(
    "--health-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve liveness over HTTP on this port: GET /healthz answers 200 while the heartbeat "
    "is recent, 503 once it stalled or the worker is stopping.",
)
@click.option(
    "--health-host", default="0.0.0.0", show_default=True, help="Address of --health-port."
)
@click.option(
    "--health-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Touch this file on every heartbeat (removed at stop), for an exec probe.",
)
@click.option(
    "--connections",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Most connections the worker holds for claims, acks, heartbeats, maintenance and LISTEN (fewer "
    "when a fleet would not fit max_connections; 1: one does it all, and the worker polls).",
)
@click.option(
    "--tx-pool-size",
    type=click.IntRange(min=1),
    default=None,
    help="Connections for transactional-completion handlers, opened as they run "
    "(default: the concurrency).",
)
@click.option("--log-level", default="INFO", show_default=True)
@db_options
@friendly_errors
def worker(
    app_spec: str,
    queues: str | None,
    concurrency: int,
    prefetch: int | None,
    lease: float,
    heartbeat_interval: float | None,
    poll_interval: float,
    grace_period: float,
    no_listen: bool,
    retention: str,
    dead_retention: str,
    archive: bool,
    archive_retention: str,
    event_loop: str,
    health_port: int | None,
    health_host: str,
    health_file: str | None,
    connections: int,
    tx_pool_size: int | None,
    log_level: str,
    dsn: str | None,
    schema: str,
) -> None:
    """Run a worker until SIGTERM/SIGINT (a second signal exits at once)."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:  # records written during a job name it
        handler.addFilter(JobLogFilter())
    app = make_app(dsn, schema, app_spec, interactive=False)
    app.run_worker(
        queues=[name.strip() for name in queues.split(",") if name.strip()] if queues else None,
        concurrency=concurrency,
        prefetch=prefetch,
        lease=lease,
        heartbeat_interval=heartbeat_interval,
        poll_interval=poll_interval,
        grace_period=grace_period,
        listen=not no_listen,
        retention=_retention("--retention", retention),
        dead_retention=_retention("--dead-retention", dead_retention),
        archive=archive,
        archive_retention=_retention("--archive-retention", archive_retention),
        event_loop=event_loop,
        health_port=health_port,
        health_host=health_host,
        health_file=health_file,
        connections=connections,
        tx_pool_size=tx_pool_size,
    )


def _retention(flag: str, value: str) -> float | None:
    """A retention flag's seconds; 'none' keeps forever."""
    if value.strip().lower() == "none":
        return None
    try:
        return parse_duration(value, flag)
    except PgQueueError as exc:
        raise ConfigurationError(str(exc)) from None


main.add_command(schedules_command, "schedules")
main.add_command(bench_command, "bench")


@main.command()
@click.option(
    "--dsn", envvar="PGQUEUE_DSN",
    help="Use this database (default: $PGQUEUE_DSN, else $DATABASE_URL, else a throwaway "
    "PostgreSQL that is removed on Ctrl-C).",
)  # fmt: skip
@click.option(
    "--schema", default=None,
    help="Schema of the demo's tables (default: public in a throwaway database, "
    "pgqueue_demo in yours).",
)  # fmt: skip
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Dashboard port (a free one if it is taken).")  # fmt: skip
@click.option(
    "--postgres", "backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
    help="Throwaway server: the local PostgreSQL binaries, the pgserver package "
    "(pgqueue-jobs[embedded]), or auto (local first).",
)  # fmt: skip
@friendly_errors
def demo(dsn: str | None, schema: str | None, port: int, backend: str) -> None:
    """Run a live demo: PostgreSQL, demo tasks, producers, two workers and the dashboard."""
    from .demo.runner import run_demo

    if schema is not None:
        validate_schema(schema)
    sys.exit(run_demo(dsn=dsn or os.environ.get("DATABASE_URL"), schema=schema, port=port,
                      backend=backend))  # fmt: skip


try:
    from .dashboard.cli import dashboard_command
except ImportError:  # the optional extra is not installed

    @main.command("dashboard", context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def dashboard_command(args: tuple[str, ...]) -> None:
        """Serve the read-only dashboard (needs `pip install 'pgqueue-jobs[dashboard]'`)."""
        click.echo(
            "error: the dashboard needs its extra: pip install 'pgqueue-jobs[dashboard]'", err=True
        )
        sys.exit(1)
else:
    main.add_command(dashboard_command, "dashboard")

environment.read_from_environment(main)

if __name__ == "__main__":
    main()
