"""A primary and a hot standby streaming from it, both throwaway clusters from the local
PostgreSQL binaries: for what must work against a read replica (the dashboard) and, by promoting
the standby, for failover.

As root every binary runs as the ``postgres`` user, as ``EmbeddedPostgres`` does: initdb,
pg_basebackup and the servers refuse root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from pgqueue.embedded import EmbeddedPostgres
from tests.helpers import wait_until


class Standby(EmbeddedPostgres):
    """A hot standby of ``primary``: ``pg_basebackup -R`` (a base backup with
    ``standby.signal`` and ``primary_conninfo``) into a data directory of its own, started on
    its own port. ``hot_standby`` is on by default, so it takes read-only connections."""

    def __init__(self, primary: EmbeddedPostgres) -> None:
        # initdb may be a symlink on PATH (/usr/local/bin) to a directory that also holds
        # pg_basebackup: follow it.
        super().__init__(bindir=(primary.bindir / "initdb").resolve().parent)
        self.primary = primary

    def start(self) -> Standby:
        # The primary's default pg_hba.conf (initdb --auth=trust) admits replication from
        # 127.0.0.1, and wal_level=replica with 10 WAL senders is PostgreSQL's default.
        source = f"host=127.0.0.1 port={self.primary.port} user={self.primary.user}"
        self._run(
            "pg_basebackup", "-D", str(self.datadir), "-R", "-X", "stream",
            "--checkpoint=fast", "--no-sync", "-d", f"{source} application_name=standby",
        )  # fmt: skip
        self.start_server()
        return self

    def promote(self) -> None:
        """End recovery: the standby becomes a primary that accepts writes (failover)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "promote")

    def server_log(self) -> str:
        path = self.tmp / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Replicated:
    primary: EmbeddedPostgres
    standby: Standby

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        lsn = str(row[0])
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:

            def replayed() -> Any:
                found = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)
                ).fetchone()
                return found is not None and found[0]

            wait_until(replayed, timeout=timeout, interval=0.05, what=f"standby replays {lsn}")


@contextlib.contextmanager
def replicated() -> Iterator[Replicated]:
    """A fresh primary and a hot standby streaming from it; both removed afterwards."""
    primary = EmbeddedPostgres()
    try:
        primary.start()
        standby = Standby(primary)
        try:
            yield Replicated(primary, standby.start())
        finally:
            standby.stop()
    finally:
        primary.stop()
