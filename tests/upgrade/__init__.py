"""Test-only upgrade material, never shipped: ``migrations/`` holds migrations numbered after any
real one that change ``pgqueue_jobs`` as a future release might (a column, then an index built
concurrently), ``app`` is the app of the upgrade tests' worker processes, and this module has
what those tests share."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from pgqueue.migrate import Migration, available, migrate

#: The shipped migrations, then the test-only ones.
UPGRADE = [*available(), *available("tests.upgrade")]
TEST_VERSIONS = [m.version for m in available("tests.upgrade")]
INDEX = "pgqueue_jobs_upgrade_probe_idx"

Conn = psycopg.Connection[tuple[Any, ...]]


class Migrator(threading.Thread):
    """``migrate()`` in a thread, on a connection named ``application`` so that tests can find its
    backend in pg_stat_activity."""

    def __init__(
        self,
        dsn: str,
        migrations: list[Migration],
        application: str = "migrator",
        *,
        lock_timeout: float,
        timeout: float,
    ) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.migrations = migrations
        self.application = application
        self.lock_timeout = lock_timeout
        self.timeout = timeout
        self.applied: list[int] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(
                self.dsn, autocommit=True, application_name=self.application
            ) as conn:
                self.applied = migrate(
                    conn,
                    migrations=self.migrations,
                    lock_timeout=self.lock_timeout,
                    timeout=self.timeout,
                )
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = 60) -> list[int]:
        self.join(timeout)
        assert not self.is_alive(), "the migration did not finish"
        assert self.error is None, repr(self.error)
        assert self.applied is not None
        return self.applied


def backend_waiting(conn: Conn, name: str, event: str | None = None) -> int | None:
    """The pid of the session named ``name`` while it waits for a lock (of kind ``event``,
    e.g. 'advisory' or 'virtualxid', when given)."""
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
        " AND wait_event_type = 'Lock' AND (%s::text IS NULL OR wait_event = %s)",
        (name, event, event),
    ).fetchone()
    return None if row is None else int(row[0])


def index_state(conn: Conn) -> tuple[bool, bool] | None:
    """(valid, ready) of the test migrations' index; None while it does not exist."""
    row = conn.execute(
        "SELECT indisvalid, indisready FROM pg_index WHERE indexrelid = to_regclass(%s)", (INDEX,)
    ).fetchone()
    return None if row is None else (bool(row[0]), bool(row[1]))


def upgraded(conn: Conn) -> bool:
    """The test migrations' column and index exist, and the index is valid."""
    column = conn.execute(
        "SELECT 1 FROM information_schema.columns"
        " WHERE table_name = 'pgqueue_jobs' AND column_name = 'upgrade_probe'"
    ).fetchone()
    return column is not None and index_state(conn) == (True, True)
