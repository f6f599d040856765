"""The dashboard's one database connection: every read is an explicit READ ONLY transaction.

A single connection serves the refresh loop and the rare job-detail fetch (a lock takes turns),
so a dashboard costs one backend however many pages are open.

The guards are set per transaction, never for the session: ``BEGIN ... READ ONLY`` and
``set_config(..., is_local => true)``. A session default (``default_transaction_read_only`` in
the startup ``options``) can be turned back off from inside the session (``SET SESSION
CHARACTERISTICS AS TRANSACTION READ WRITE``); an explicit ``READ ONLY`` on every ``BEGIN``
cannot. Startup ``options`` are also refused by PgBouncer, and a transaction-pooling PgBouncer
would hand session settings to other clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any, LiteralString

import psycopg
from psycopg import IsolationLevel

APPLICATION_NAME = "pgqueue-dashboard"

# One SELECT, so it also takes the transaction's snapshot: after it, `SET TRANSACTION READ
# WRITE` is refused ("must be set before any query"). No parallel workers and no JIT: every
# panel reads a few index pages, and the planner's guess of 100 rows per jsonb_each_text would
# otherwise launch workers (30 ms of startup for 1 ms of work) and take them from the
# application's own queries. No sequential scan where an index serves: every statement is
# written as an index read, but skewed statistics mislead the planner. One group callback with
# 20,000 parents makes "child_id = <a job's id>" look like 10,000 rows, and the Running and
# Problems panels then scanned all of pgqueue_job_deps once per job listed (110 ms a refresh
# instead of 0.8).
TRANSACTION_SETTINGS: LiteralString = (
    "SELECT set_config('statement_timeout', %(timeout)s, true),"
    " set_config('idle_in_transaction_session_timeout', '60000', true),"
    " set_config('max_parallel_workers_per_gather', '0', true),"
    " set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true)"
)

# Can the connected role write to pgqueue's tables? A superuser can write anything, and can
# also undo any read-only setting; a role with INSERT, UPDATE or DELETE on a table could write
# if the read-only transaction were ever bypassed. Catalog lookups only: run once at start.
CAN_WRITE: LiteralString = """
SELECT r.rolsuper,
       COALESCE(array_agg(c.relname ORDER BY c.relname) FILTER (
           WHERE has_table_privilege(c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE')), '{}')
FROM pg_roles r
LEFT JOIN pg_class c
       ON c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)
      AND c.relkind IN ('r', 'p')
      AND c.relname LIKE 'pgqueue\\_%%'
WHERE r.rolname = current_user
GROUP BY r.rolsuper
"""


def session_options() -> dict[str, Any]:
    """Connection keywords. No startup ``options``: the DSN's own are kept as they are.

    No server-side prepared statements (``prepare_threshold=None``): a prepared statement lives
    on one server connection, and a transaction-pooling PgBouncer before 1.21 hands the next
    transaction another one (``prepared statement "_pg3_0" does not exist``). They would buy the
    dashboard nothing anyway: psycopg forgets them at every ROLLBACK, and every dashboard read
    ends in one, so no statement ever reached its fifth execution."""
    return {
        "autocommit": True,
        "application_name": APPLICATION_NAME,
        "connect_timeout": 3,
        "prepare_threshold": None,
    }


async def make_read_only(conn: psycopg.AsyncConnection[Any]) -> None:
    """Every ``conn.transaction()`` then begins with ``BEGIN ISOLATION LEVEL REPEATABLE READ
    READ ONLY`` (one instant for every panel), whatever the session's defaults say."""
    await conn.set_isolation_level(IsolationLevel.REPEATABLE_READ)
    await conn.set_read_only(True)


@contextlib.asynccontextmanager
async def read_only_transaction(
    conn: psycopg.AsyncConnection[Any], statement_timeout_ms: int
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A READ ONLY transaction with the dashboard's limits, on a connection from
    :func:`make_read_only`. It is rolled back, never committed: what a read-only transaction
    still allows (``NOTIFY``, ``lo_create``, ``SET SESSION ...``) takes effect only at commit,
    so nothing run in it outlives it."""
    if conn.read_only is not True:
        raise psycopg.ProgrammingError("the dashboard reads only on a read-only connection")
    async with conn.transaction() as tx:
        await conn.execute(TRANSACTION_SETTINGS, {"timeout": str(int(statement_timeout_ms))})
        yield conn
        raise psycopg.Rollback(tx)


async def writable_tables(conn: psycopg.AsyncConnection[Any], schema: str) -> list[str]:
    """The pgqueue tables the connected role could write to (``["*"]`` for a superuser)."""
    cur = await conn.execute(CAN_WRITE, {"schema": schema})
    row = await cur.fetchone()
    if row is None:
        return []
    return ["*"] if row[0] else [str(name) for name in row[1]]


class Database:
    def __init__(self, dsn: str, *, statement_timeout_ms: int = 5000) -> None:
        self.dsn = dsn
        self.statement_timeout_ms = statement_timeout_ms
        self.kwargs = session_options()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        #: Read transactions run: what the dashboard costs the database, whatever the open pages.
        self.uses = 0

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The connection, inside one READ ONLY transaction with the dashboard's limits, which
        is rolled back at the end (see :func:`read_only_transaction`)."""
        async with self._lock:
            self.uses += 1
            if self._conn is None or self._conn.closed or self._conn.broken:
                await self._drop()
                self._conn = await psycopg.AsyncConnection.connect(self.dsn, **self.kwargs)
                await make_read_only(self._conn)
            try:
                async with read_only_transaction(self._conn, self.statement_timeout_ms) as conn:
                    yield conn
            except psycopg.OperationalError:
                await self._drop()  # a dead server or a terminated backend: reconnect next time
                raise

    async def reachable(self, timeout: float) -> str | None:
        """None if PostgreSQL answers ``SELECT 1`` within ``timeout`` seconds, else why not. Its
        own short-lived connection: a probe never waits behind the refresh's session, and a
        timed-out probe never leaves that session mid-query."""

        async def ping() -> None:
            options = {**self.kwargs, "connect_timeout": max(1, math.ceil(timeout)),
                       "application_name": f"{APPLICATION_NAME}-probe"}  # fmt: skip
            async with await psycopg.AsyncConnection.connect(self.dsn, **options) as conn:
                await conn.execute("SELECT 1")

        try:
            await asyncio.wait_for(ping(), timeout)
        except TimeoutError:
            return f"no answer within {timeout:g} s"
        except (psycopg.Error, OSError) as exc:
            return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return None

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
