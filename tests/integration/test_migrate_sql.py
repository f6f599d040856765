"""`pgqueue migrate --sql`: the printed script, run by psql as a DBA or another migration tool
would, builds the schema `pgqueue migrate` builds, records its versions, and workers run on it."""

from __future__ import annotations

import glob
import shutil
import subprocess
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import pgqueue
from pgqueue.cli import main
from pgqueue.migrate import applied_versions, available, migrate, split_statements
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]
LATEST = available()[-1].version


def printed(*args: str) -> str:
    result = CliRunner().invoke(main, ["migrate", "--sql", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def psql() -> str | None:
    return shutil.which("psql") or next(
        iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/psql"))), None
    )


def run_script(dsn: str, script: str) -> None:
    """As `psql -v ON_ERROR_STOP=1 -f` runs it; without psql, statement by statement on an
    autocommit connection, which is what psql does."""
    found = psql()
    if found:
        subprocess.run(
            [found, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-"],
            input=script, text=True, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in split_statements(script):
            conn.execute(statement.encode())


def catalog(dsn: str, schema: str = "public") -> dict[str, Any]:
    """What a migration leaves in a schema: tables and columns, indexes, constraints, enum
    values, functions, triggers and table options."""
    queries = {
        "columns": """SELECT table_name, column_name, data_type, udt_name, column_default,
                             is_nullable, ordinal_position
                      FROM information_schema.columns WHERE table_schema = %(s)s""",
        "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s",
        "constraints": """SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)
                          FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
                          WHERE n.nspname = %(s)s""",
        "enums": """SELECT t.typname, e.enumlabel, e.enumsortorder FROM pg_enum e
                    JOIN pg_type t ON t.oid = e.enumtypid
                    JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = %(s)s""",
        "functions": """SELECT p.proname, md5(p.prosrc) FROM pg_proc p
                        JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(s)s""",
        "triggers": """SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid)
                       FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                       JOIN pg_namespace n ON n.oid = c.relnamespace
                       WHERE n.nspname = %(s)s AND NOT t.tgisinternal""",
        "options": """SELECT c.relname, c.relkind, c.reloptions FROM pg_class c
                      JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(s)s""",
        "valid_indexes": """SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                            JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE n.nspname = %(s)s AND NOT (i.indisvalid AND i.indisready)""",
    }
    with psycopg.connect(dsn) as conn:
        return {
            name: sorted(map(str, conn.execute(query, {"s": schema}).fetchall()))
            for name, query in queries.items()
        }


def test_the_printed_script_builds_what_migrate_builds(dsn: str, empty_dsn: str) -> None:
    run_script(empty_dsn, printed())
    with psycopg.connect(empty_dsn) as conn:
        assert applied_versions(conn) == [m.version for m in available()]
    assert catalog(empty_dsn) == catalog(dsn)  # `dsn`: migrated by `pgqueue migrate`
    again = CliRunner().invoke(main, ["migrate", "--dsn", empty_dsn], catch_exceptions=False)
    assert again.output.strip() == "schema is up to date"


async def test_workers_run_on_a_schema_the_script_built(empty_dsn: str) -> None:
    run_script(empty_dsn, printed("--schema", "jobs_by_dba"))
    app = pgqueue.App(empty_dsn, schema="jobs_by_dba")
    try:
        assert app.migrate() == []

        @app.task
        async def add(a: int, b: int) -> int:
            return a + b

        job = add.enqueue(a=2, b=3)
        async with running_worker(app, poll_interval=0.05):
            await wait_until_async(lambda: getattr(app.get_job(job), "status", None) == "succeeded")
        found = app.get_job(job)
        assert found is not None and found.result == 5
    finally:
        app.close()


def test_from_a_version_continues_a_database_migrate_left_there(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, migrations=[m for m in available() if m.version <= 10])
    run_script(empty_dsn, printed("--from", "11"))
    with psycopg.connect(empty_dsn) as conn:
        assert applied_versions(conn) == [m.version for m in available()]


def test_from_and_to_choose_the_versions_each_marked_by_a_comment() -> None:
    script = printed("--from", "10", "--to", "12")
    assert [line for line in script.splitlines() if line.startswith("-- pgqueue migration ")] == [
        "-- pgqueue migration 0010_limits",
        "-- pgqueue migration 0011_limits_indexes (no-transaction: outside any transaction, "
        "statement by statement)",
        "-- pgqueue migration 0012_job_control",
    ]
    # the concurrent builds are outside BEGIN ... COMMIT
    builds = script.index("-- pgqueue migration 0011")
    assert script.rindex("COMMIT;", 0, builds) > script.rindex("BEGIN;", 0, builds)
    assert "BEGIN;" not in script[builds : script.index("-- pgqueue migration 0012")]
    assert "{schema}" not in script and '"public".pgqueue_jobs' in script


def test_from_or_to_without_sql_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["migrate", "--from", "3"])
    assert result.exit_code == 2
    assert "--from and --to go with --sql" in result.output


def test_a_range_without_migrations_is_refused() -> None:
    result = CliRunner().invoke(main, ["migrate", "--sql", "--from", str(LATEST + 1)])
    assert result.exit_code == 1
    assert "no migration from" in result.output


def test_another_migration_running_stops_the_script(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended('pgqueue.migrate:public', 0))")
        with pytest.raises((subprocess.CalledProcessError, psycopg.errors.RaiseException)):
            run_script(empty_dsn, printed())
    with psycopg.connect(empty_dsn) as conn:
        assert applied_versions(conn) == []
