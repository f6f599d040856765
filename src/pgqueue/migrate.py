"""Applies the versioned migrations in ``pgqueue/migrations`` to a live database without stalling it.

Each migration runs in a transaction of its own and is recorded in ``pgqueue_migrations`` as it
commits, so a run that fails leaves every earlier version applied and the next run resumes. A
session advisory lock serialises migrators. Every step waits for its locks at most
``lock_timeout`` and is then rolled back and retried after a jittered pause: enqueues, claims and
acks queue behind a DDL statement's lock request, so a migration stuck behind a long transaction
would otherwise stall the whole queue for as long as that transaction lasts. After ``timeout`` the
run gives up, naming the sessions in its way. A file whose header says
``-- pgqueue: no-transaction`` runs statement by statement outside any transaction (for
``CREATE INDEX CONCURRENTLY``). docs/reference/migrations.md has the rules for writing one.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.rows import tuple_row

from .db import validate_schema
from .errors import ConfigurationError, PgQueueError
from .sql import load_sections, render

log = logging.getLogger("pgqueue.migrate")

#: Seconds a step may wait for a lock before it backs off: about the longest an enqueue, claim or
#: ack waits behind a migration.
DEFAULT_LOCK_TIMEOUT = 1.0
#: Seconds after which a run stops retrying and fails, naming what blocks it.
DEFAULT_TIMEOUT = 600.0

#: The first pause, in seconds, of a migrator polling for the migration lock (the longest is ten
#: times it): its wait blocks nobody, so it may look often.
_POLL = 0.1

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
_DIRECTIVE = re.compile(r"^\s*--\s*pgqueue:\s*(.*?)\s*$", re.IGNORECASE)
_NO_TRANSACTION = "no-transaction"

_IDENT = r"(\"(?:[^\"]|\"\")+\"|[A-Za-z_][A-Za-z0-9_$]*)"
_CREATE_CONCURRENTLY = re.compile(r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\b", re.I)
_CREATE_CONCURRENTLY_NAMED = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+" + _IDENT + r"\s+ON\b",
    re.I,
)
_DROP_CONCURRENTLY = re.compile(r"DROP\s+INDEX\s+CONCURRENTLY\b", re.I)
_DROP_CONCURRENTLY_IF_EXISTS = re.compile(r"DROP\s+INDEX\s+CONCURRENTLY\s+IF\s+EXISTS\b", re.I)
#: Statements PostgreSQL refuses inside a transaction block.
_OUTSIDE_TRANSACTION = re.compile(
    r"(?:CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY|DROP\s+INDEX\s+CONCURRENTLY"
    r"|REINDEX\b[^;]*\bCONCURRENTLY|VACUUM|CREATE\s+DATABASE|DROP\s+DATABASE|ALTER\s+SYSTEM"
    r"|(?:CREATE|DROP)\s+TABLESPACE)\b",
    re.I,
)
_TRANSACTION_CONTROL = re.compile(
    r"(?:BEGIN|START\s+TRANSACTION|COMMIT|END|ROLLBACK|ABORT|SAVEPOINT|RELEASE"
    r"|PREPARE\s+TRANSACTION)\b",
    re.I,
)
_LEADING_COMMENTS = re.compile(r"^(?:\s*--[^\n]*(?:\n|$)|\s*/\*.*?\*/)*\s*", re.S)
_DOLLAR_TAG = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$")


class MigrationError(PgQueueError):
    """A migration file is malformed, failed, or could not take its locks in time."""


@dataclass(frozen=True)
class Migration:
    """One file of ``migrations/``; parsed and checked when built, so that a malformed file fails
    at load time rather than half-way through an upgrade."""

    version: int
    name: str
    text: str
    #: False when the file's header says ``-- pgqueue: no-transaction``.
    transactional: bool = field(init=False)
    statements: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        transactional, statements = _parse(self.label, self.text)
        object.__setattr__(self, "transactional", transactional)
        object.__setattr__(self, "statements", statements)

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def available(package: str = "pgqueue") -> list[Migration]:
    """The migrations in ``<package>/migrations``, by version (pgqueue's own by default; the
    upgrade tests add a package of theirs)."""
    found = []
    for entry in resources.files(package).joinpath("migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    return _in_order(found)


def migrate(
    conn: psycopg.Connection[Any],
    schema: str = "public",
    *,
    lock_timeout: float | None = None,
    timeout: float | None = None,
    migrations: Sequence[Migration] | None = None,
) -> list[int]:
    """Apply what is missing, each migration in its own transaction; return the versions applied
    now (empty when up to date).

    ``lock_timeout`` (default 1 s) bounds each wait for a lock; the step is then rolled back and
    retried after a jittered pause, so other sessions wait behind it at most about that long per
    try. ``timeout`` (default 600 s) bounds the run's retrying: past it, a step that still cannot
    take its locks raises `MigrationError` naming the sessions that hold them. Work under
    way is never interrupted. ``migrations`` replaces the shipped ones (tests). ``conn`` must not
    be inside a transaction; it is left as it was found.
    """
    schema = validate_schema(schema)
    runner = _Runner(
        conn,
        schema,
        _seconds("lock_timeout", DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout),
        _seconds("timeout", DEFAULT_TIMEOUT if timeout is None else timeout),
    )
    return runner.run(available() if migrations is None else _in_order(migrations))


def applied_versions(conn: psycopg.Connection[Any], schema: str = "public") -> list[int]:
    schema = validate_schema(schema)
    try:
        rows = _fetch(conn, _queries(schema)["applied_migrations"])
    except psycopg.errors.UndefinedTable:
        conn.rollback()
        return []
    return [int(row[0]) for row in rows]


# --- as a script ------------------------------------------------------------------------------


def migration_script(
    schema: str = "public",
    *,
    from_version: int | None = None,
    to_version: int | None = None,
    migrations: Sequence[Migration] | None = None,
) -> str:
    """The migrations from ``from_version`` to ``to_version`` (both included; default: all) as
    one SQL script, for teams whose schema changes go through their own tool (Alembic, Django,
    Flyway) or a DBA. ``psql -v ON_ERROR_STOP=1 -f`` runs it as ``migrate()`` would: each
    version in a transaction of its own that records it in ``pgqueue_migrations`` (so a later
    ``pgqueue migrate`` finds it applied), a ``no-transaction`` version statement by statement
    outside any, under the same advisory lock. What it cannot do is the runner's lock-wait
    bounding and retrying, and its rebuild of an index left invalid by an interrupted build."""
    schema = validate_schema(schema)
    chosen = [
        m
        for m in (available() if migrations is None else _in_order(migrations))
        if (from_version is None or m.version >= from_version)
        and (to_version is None or m.version <= to_version)
    ]
    if not chosen:
        raise ConfigurationError(
            f"no migration from {from_version or 1:04d} to {to_version or 'the latest'}"
        )
    q = _queries(schema)
    key = sql.Literal(f"pgqueue.migrate:{schema}").as_string()
    name = sql.Literal(schema).as_string()
    span = chosen[0].label + (f" to {chosen[-1].label}" if len(chosen) > 1 else "")
    parts = [
        f"-- pgqueue's migrations {span}, for schema {schema}: `pgqueue migrate --sql`.",
        "-- Run with `psql -v ON_ERROR_STOP=1 -f FILE`: each version is a transaction of its own",
        "-- that records it in pgqueue_migrations; a no-transaction version (concurrent index",
        "-- builds) runs statement by statement, and each of its statements is safe to run again.",
        "",
        "-- Serialise with `pgqueue migrate` (its session lock, tried rather than waited for).",
        "DO $pgqueue$ BEGIN",
        f"    IF NOT pg_try_advisory_lock(hashtextextended({key}, 0)) THEN",
        f"        RAISE EXCEPTION 'another migration of schema % is running', {name};",
        "    END IF;",
        "END $pgqueue$;",
        "",
        f"{q['create_schema'].decode()};",
        f"{q['create_migrations_table'].decode()};",
    ]
    for migration in chosen:
        record = render(
            "INSERT INTO {schema}.pgqueue_migrations (version, name) VALUES ({version}, {name})",
            schema,
            version=str(migration.version),
            name=sql.Literal(migration.name).as_string(),
        ).decode()
        if migration.transactional:
            body = render(_terminated(migration.text), schema).decode().strip()
            parts += ["", f"-- pgqueue migration {migration.label}", "BEGIN;", body,
                      f"{record};", "COMMIT;"]  # fmt: skip
        else:
            parts += ["", f"-- pgqueue migration {migration.label} (no-transaction: outside any"
                      " transaction, statement by statement)"]  # fmt: skip
            parts += [f"{render(s, schema).decode()};" for s in migration.statements]
            parts.append(f"{record};")
    parts += ["", f"SELECT pg_advisory_unlock(hashtextextended({key}, 0));", ""]
    return "\n".join(parts)


def _terminated(text: str) -> str:
    """The file's text with a semicolon after its last statement (which may lack one)."""
    lines = text.rstrip().splitlines()
    tail: list[str] = []
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("--")):
        tail.insert(0, lines.pop())
    if lines and not lines[-1].rstrip().endswith(";"):
        lines[-1] = lines[-1].rstrip() + ";"
    return "\n".join(lines + tail)


# --- running ---------------------------------------------------------------------------------


class _Runner:
    def __init__(
        self, conn: psycopg.Connection[Any], schema: str, lock_timeout: float, timeout: float
    ) -> None:
        self.conn = conn
        self.schema = schema
        self.q = _queries(schema)
        self.lock_timeout = lock_timeout
        self.timeout = timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout

    def run(self, migrations: list[Migration]) -> list[int]:
        conn = self.conn
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            raise ConfigurationError(
                "migrate() needs a connection that is not inside a transaction: "
                "it commits each migration on its own"
            )
        autocommit = conn.autocommit
        conn.autocommit = True
        original = str(_fetch(conn, self.q["current_lock_timeout"])[0][0])
        locked = False
        try:
            self._lock()
            locked = True
            self._attempt("creating the migrations table", self._bootstrap, concurrent=False)
            done = {int(row[0]) for row in _fetch(conn, self.q["applied_migrations"])}
            applied: list[int] = []
            for migration in migrations:
                if migration.version not in done:
                    self._apply(migration)
                    applied.append(migration.version)
                    log.info("applied migration %s", migration.label)
            return applied
        finally:
            self._restore(locked, original, autocommit)

    def _lock(self) -> None:
        """Wait for another migrator for up to the whole timeout, polling (see
        try_lock_migrations); that wait blocks nobody."""
        tries = 0
        while not _fetch(self.conn, self.q["try_lock_migrations"], {"schema": self.schema})[0][0]:
            tries += 1
            pause = _pause(tries, _POLL)
            giving_up = time.monotonic() + pause >= self.deadline
            if tries == 1 or giving_up:
                holder = _describe(
                    _fetch(self.conn, self.q["migration_lock_holder"], {"schema": self.schema}),
                    "held by",
                    "connected for",
                )
                if giving_up:
                    raise MigrationError(
                        f"another migration of schema {self.schema!r} held the migration lock "
                        f"for all of {self.timeout:g} s ({holder}): try again once it ends"
                    )
                log.warning(
                    "another migration of schema %r is running (%s); waiting for it",
                    self.schema,
                    holder,
                )
            time.sleep(pause)

    def _bootstrap(self, wait: float) -> None:
        with self.conn.transaction():
            self._set_lock_timeout(wait, local=True)
            self.conn.execute(self.q["create_schema"])
            self.conn.execute(self.q["create_migrations_table"])

    def _apply(self, migration: Migration) -> None:
        record = {"version": migration.version, "name": migration.name}
        if migration.transactional:

            def in_one_transaction(wait: float) -> None:
                with self.conn.transaction():
                    self._set_lock_timeout(wait, local=True)
                    self.conn.execute(render(migration.text, self.schema))
                    self.conn.execute(self.q["record_migration"], record)

            self._attempt(f"migration {migration.label}", in_one_transaction, concurrent=False)
            return
        for statement in migration.statements:
            index = _built_index(statement)
            rendered = render(statement, self.schema)

            def on_its_own(
                wait: float, rendered: bytes = rendered, index: str | None = index
            ) -> None:
                self._set_lock_timeout(wait, local=False)
                if index is not None:
                    self._drop_if_invalid(migration, index)
                self.conn.execute(rendered)

            concurrent = bool(
                _CREATE_CONCURRENTLY.match(statement) or _DROP_CONCURRENTLY.match(statement)
            )
            self._attempt(f"migration {migration.label}", on_its_own, concurrent=concurrent)
        self.conn.execute(self.q["record_migration"], record)

    def _drop_if_invalid(self, migration: Migration, index: str) -> None:
        found = _fetch(
            self.conn, self.q["index_is_invalid"], {"schema_name": self.schema, "index": index}
        )
        if found and found[0][0]:
            log.warning(
                "migration %s: dropping index %s, left invalid by an interrupted build, to build "
                "it again",
                migration.label,
                index,
            )
            self.conn.execute(_drop_index(self.schema, index))

    def _attempt(self, what: str, step: Callable[[float], None], *, concurrent: bool) -> None:
        """Run ``step`` until it gets its locks. A concurrent index build or drop takes only a
        SHARE UPDATE EXCLUSIVE lock, which no enqueue, claim or ack conflicts with, and then
        waits for older transactions: that wait blocks nobody, so it may last the rest of the
        run's time rather than be restarted (and its index rebuilt) every ``lock_timeout``."""
        tries = 0
        while True:
            remaining = self.deadline - time.monotonic()
            wait = max(self.lock_timeout, remaining) if concurrent else self.lock_timeout
            try:
                step(wait)
                return
            except psycopg.errors.LockNotAvailable:
                tries += 1
                blockers = _describe(
                    _fetch(
                        self.conn,
                        self.q["lock_holders"],
                        {"waited": wait, "schema_name": self.schema, "snapshots": concurrent},
                    ),
                    "blocked by",
                    "transaction open for",
                )
                pause = _pause(tries, self.lock_timeout)
                if time.monotonic() + pause >= self.deadline:
                    raise MigrationError(
                        f"{what} could not take its locks within the {self.timeout:g} s timeout "
                        f"({tries} {'try' if tries == 1 else 'tries'}): {blockers}; the "
                        "migrations before it are applied, run migrate again once that ends"
                    ) from None
                log.warning(
                    "%s is waiting for locks (%s); trying again in %.1f s", what, blockers, pause
                )
                time.sleep(pause)
            except psycopg.OperationalError:
                raise  # the connection or the server: not the migration's fault
            except psycopg.DatabaseError as exc:
                reason = exc.diag.message_primary or str(exc).strip().splitlines()[0]
                raise MigrationError(f"{what} failed: {reason}") from exc

    def _set_lock_timeout(self, seconds: float, *, local: bool) -> None:
        milliseconds = max(1, min(int(seconds * 1000), 2_147_483_647))
        self.conn.execute(
            self.q["set_lock_timeout"], {"value": f"{milliseconds}ms", "local": local}
        )

    def _restore(self, locked: bool, lock_timeout: str, autocommit: bool) -> None:
        """Release the lock and give the connection back as it came, on every way out; a broken
        connection has nothing left to release (the server dropped the lock with it)."""
        conn = self.conn
        if conn.closed or conn.broken:
            return
        try:
            if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                conn.rollback()
            conn.execute(self.q["set_lock_timeout"], {"value": lock_timeout, "local": False})
            if locked:
                conn.execute(self.q["unlock_migrations"], {"schema": self.schema})
            conn.autocommit = autocommit
        except psycopg.Error as exc:
            log.warning("could not reset the migration connection: %s", exc)


def _pause(tries: int, lock_timeout: float) -> float:
    """Jittered exponential backoff from half the lock timeout up to ten times it (a minute at
    most): while a long transaction blocks a migration, others wait behind it at most about a
    sixth of the time, and two migrators (or retries of several) do not fall into step."""
    ceiling = min(10 * lock_timeout, 60.0, lock_timeout / 2 * 2 ** min(tries - 1, 16))
    return random.uniform(ceiling / 2, ceiling)


def _describe(holders: list[tuple[Any, ...]], verb: str, age: str) -> str:
    """``blocked by pid 123 (idle in transaction, transaction open for 45 s, application 'psql':
    SELECT ...)``: what an operator needs to find the session, and to end it if it must."""
    if not holders:
        return "the sessions that held them have ended since"
    parts = []
    for pid, state, seconds, application, query in holders:
        text = " ".join(_LEADING_COMMENTS.sub("", str(query)).split())
        text = text if len(text) <= 120 else text[:117] + "..."
        origin = f", application {application!r}" if application else ""
        parts.append(
            f"pid {pid} ({state or 'state unknown'}, {age} {float(seconds or 0):.0f} s{origin}: "
            f"{text})"
        )
    return f"{verb} {', '.join(parts)}"


# --- statements and files --------------------------------------------------------------------


@cache
def _queries(schema: str) -> dict[str, bytes]:
    """migrate.sql's sections rendered for one schema (drop_index is rendered per index)."""
    return {
        name: render(body, schema)
        for name, body in load_sections("pgqueue", "migrate.sql").items()
        if name != "drop_index"
    }


def _drop_index(schema: str, index: str) -> bytes:
    body = load_sections("pgqueue", "migrate.sql")["drop_index"]
    return render(body, schema, index=sql.Identifier(index).as_string())


def _fetch(
    conn: psycopg.Connection[Any], query: bytes, params: dict[str, Any] | None = None
) -> list[tuple[Any, ...]]:
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def _seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _in_order(migrations: Sequence[Migration]) -> list[Migration]:
    ordered = sorted(migrations, key=lambda m: m.version)
    for before, after in itertools.pairwise(ordered):
        if before.version == after.version:
            raise MigrationError(
                f"two migrations are numbered {after.version:04d}: {before.label} and {after.label}"
            )
    return ordered


def _built_index(statement: str) -> str | None:
    """The index a CREATE INDEX CONCURRENTLY statement builds, as PostgreSQL names it."""
    match = _CREATE_CONCURRENTLY_NAMED.match(statement)
    if match is None:
        return None
    name = match[1]
    return name[1:-1].replace('""', '"') if name.startswith('"') else name.lower()


def _parse(label: str, text: str) -> tuple[bool, tuple[str, ...]]:
    """The file's mode (from its header's directives) and its statements, checked against the
    rules of docs/reference/migrations.md."""
    transactional = True
    lines = text.splitlines()
    header = 0
    while header < len(lines) and (not lines[header].strip() or lines[header].lstrip()[:2] == "--"):
        directive = _DIRECTIVE.match(lines[header])
        if directive:
            if directive[1].lower() != _NO_TRANSACTION:
                raise MigrationError(
                    f"migration {label}: unknown directive {directive[1]!r} "
                    f"(the one there is: -- pgqueue: {_NO_TRANSACTION})"
                )
            transactional = False
        header += 1
    if any(_DIRECTIVE.match(line) for line in lines[header:]):
        raise MigrationError(
            f"migration {label}: a '-- pgqueue:' directive must be in the comment lines at the "
            "top of the file"
        )
    statements = tuple(split_statements(text))
    if not statements:
        raise MigrationError(f"migration {label} has no statements")
    for statement in statements:
        words = " ".join(statement.split()[:4])
        if _TRANSACTION_CONTROL.match(statement):
            raise MigrationError(
                f"migration {label}: {words!r}: leave transaction control out, the runner gives "
                "each migration a transaction of its own"
            )
        if transactional and _OUTSIDE_TRANSACTION.match(statement):
            raise MigrationError(
                f"migration {label}: {words!r} cannot run inside a transaction: put "
                f"'-- pgqueue: {_NO_TRANSACTION}' at the top of the file"
            )
        if _CREATE_CONCURRENTLY.match(statement) and not _CREATE_CONCURRENTLY_NAMED.match(
            statement
        ):
            raise MigrationError(
                f"migration {label}: {words!r} must name its index and say IF NOT EXISTS, so that "
                "an interrupted run can be resumed"
            )
        if _DROP_CONCURRENTLY.match(statement) and not _DROP_CONCURRENTLY_IF_EXISTS.match(
            statement
        ):
            raise MigrationError(
                f"migration {label}: {words!r} must say IF EXISTS, so that an interrupted run can "
                "be resumed"
            )
    return transactional, statements


def split_statements(text: str) -> list[str]:
    """The statements of an SQL script, split at semicolons outside quotes, dollar quotes and
    comments; each starts at its first token (leading comments dropped), and comment-only
    pieces are left out."""
    statements: list[str] = []
    start: int | None = None  # where the current statement's first token is
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        if text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            continue
        if char.isspace():
            i += 1
            continue
        if start is None:
            start = i
        if char == ";":
            statements.append(text[start:i].strip())
            start = None
            i += 1
        elif char == "'":
            i = _end_of_string(text, i)
        elif char == '"':
            end = i + 1
            while end < n and (text[end] != '"' or text.startswith('""', end)):
                end += 2 if text.startswith('""', end) else 1
            i = end + 1
        elif char == "$" and (tag := _DOLLAR_TAG.match(text, i)) and not _word_char(text, i - 1):
            end = text.find(tag[0], tag.end())
            i = n if end < 0 else end + len(tag[0])
        else:
            i += 1
    if start is not None:
        statements.append(text[start:].strip())
    return [s for s in statements if s]


def _end_of_string(text: str, i: int) -> int:
    """Past the literal opening at ``i``: doubled quotes, and backslash escapes in E'...'."""
    escapes = text[i - 1 : i] in ("e", "E") and not _word_char(text, i - 2)
    i += 1
    while i < len(text):
        if (escapes and text[i] == "\\") or text.startswith("''", i):
            i += 2
        elif text[i] == "'":
            return i + 1
        else:
            i += 1
    return i


def _word_char(text: str, i: int) -> bool:
    return 0 <= i < len(text) and (text[i].isalnum() or text[i] in "_$")
