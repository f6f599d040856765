"""Applies the versioned migrations shipped in ``pgqueue/migrations`` under an advisory lock.

All pending migrations run in one transaction after ``pg_advisory_xact_lock``: a second process
migrating at the same moment waits, then finds nothing left to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg
from psycopg import sql

from .db import validate_schema
from .sql import render

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def available() -> list[Migration]:
    found = []
    for entry in resources.files("pgqueue").joinpath("migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    return sorted(found, key=lambda m: m.version)


def migrate(conn: psycopg.Connection[object], schema: str = "public") -> list[int]:
    """Apply what is missing; return the versions applied now (empty when up to date)."""
    schema = validate_schema(schema)
    ident = sql.Identifier(schema)
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('pgqueue.migrate:' || %s, 0))",
            (schema,),
        )
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.pgqueue_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        rows = conn.execute(
            sql.SQL("SELECT version FROM {}.pgqueue_migrations").format(ident)
        ).fetchall()
        done = {int(row[0]) for row in rows}  # type: ignore[index]
        for migration in available():
            if migration.version in done:
                continue
            conn.execute(render(migration.text, schema))
            conn.execute(
                sql.SQL("INSERT INTO {}.pgqueue_migrations (version, name) VALUES (%s, %s)").format(
                    ident
                ),
                (migration.version, migration.name),
            )
            applied_now.append(migration.version)
    return applied_now


def applied_versions(conn: psycopg.Connection[object], schema: str = "public") -> list[int]:
    ident = sql.Identifier(validate_schema(schema))
    try:
        rows = conn.execute(
            sql.SQL("SELECT version FROM {}.pgqueue_migrations ORDER BY version").format(ident)
        ).fetchall()
    except psycopg.errors.UndefinedTable:
        conn.rollback()
        return []
    return [int(row[0]) for row in rows]  # type: ignore[index]
