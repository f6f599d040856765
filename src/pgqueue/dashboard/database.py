"""The dashboard's one database session: read-only, time-limited, re-established on demand.

A single connection serves the refresh loop and the rare job-detail fetch (a lock takes turns),
so a dashboard costs one backend however many pages are open. Every session is read-only at the
server (``default_transaction_read_only``) and bounded by ``statement_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg import conninfo

APPLICATION_NAME = "pgqueue-dashboard"


def session_options(dsn: str, statement_timeout_ms: int) -> dict[str, Any]:
    """Connection keywords: the DSN's own ``options`` kept, the read-only settings added."""
    existing = conninfo.conninfo_to_dict(dsn).get("options") or ""
    # No parallel workers and no JIT: every panel reads a few index pages, and the planner's
    # guess of 100 rows per jsonb_each_text would otherwise launch workers (30 ms of startup
    # for 1 ms of work) and take them from the application's own queries.
    # No sequential scan where an index serves: every statement is written as an index read, but
    # skewed statistics mislead the planner. One group callback with 20,000 parents makes
    # "child_id = <a job's id>" look like 10,000 rows, and the Running and Problems panels then
    # scanned all of pgqueue_job_deps once per job listed (110 ms a refresh instead of 0.8).
    ours = (
        f"-c default_transaction_read_only=on -c statement_timeout={int(statement_timeout_ms)}"
        " -c idle_in_transaction_session_timeout=60000 -c max_parallel_workers_per_gather=0"
        " -c jit=off -c enable_seqscan=off"
    )
    return {
        "autocommit": True,
        "options": f"{existing} {ours}".strip(),
        "application_name": APPLICATION_NAME,
        "connect_timeout": 3,
    }


class Database:
    def __init__(self, dsn: str, *, statement_timeout_ms: int = 5000) -> None:
        self.dsn = dsn
        self.kwargs = session_options(dsn, statement_timeout_ms)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        #: Sessions handed out: what the dashboard costs the database, whatever the open pages.
        self.uses = 0

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._lock:
            self.uses += 1
            if self._conn is None or self._conn.closed or self._conn.broken:
                await self._drop()
                self._conn = await psycopg.AsyncConnection.connect(self.dsn, **self.kwargs)
            try:
                yield self._conn
            except psycopg.OperationalError:
                await self._drop()  # a dead server or a terminated backend: reconnect next time
                raise

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
