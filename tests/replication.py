"""A primary and a hot standby streaming from it, both throwaway clusters from the local
PostgreSQL binaries: for what must work against a read replica (the dashboard) and, by killing
the primary and promoting the standby, for failover (synchronous replication or asynchronous).

As root every binary runs as the ``postgres`` user, as ``EmbeddedPostgres`` does: initdb,
pg_basebackup and the servers refuse root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from psycopg import conninfo

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

    @property
    def dsn(self) -> str:
        """Both servers, as an application configured for failover names them: libpq tries
        each in turn and keeps the one that accepts writes."""
        return conninfo.make_conninfo(
            host="127.0.0.1,127.0.0.1",
            port=f"{self.primary.port},{self.standby.port}",
            user=self.primary.user,
            dbname="postgres",
            target_session_attrs="read-write",
        )

    def synchronous(self) -> None:
        """Synchronous replication: from now on a COMMIT returns once the standby has flushed
        its WAL (``synchronous_commit = on``), so a committed transaction survives the
        primary's loss."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby'")
            conn.execute("SELECT pg_reload_conf()")
            wait_until(
                lambda: conn.execute(
                    "SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync'"
                ).fetchone(),
                what="the standby is synchronous",
            )

    def lag_bytes(self) -> int:
        """WAL the primary has written that the standby has not flushed yet."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)::bigint"
                " FROM pg_stat_replication"
            ).fetchone()
        assert row is not None
        return int(row[0])

    def fail_over(self) -> None:
        """The primary crashes (``pg_ctl -m immediate stop``: no shutdown checkpoint, every
        session cut) and the standby is promoted."""
        self.primary.stop_server("immediate")
        self.standby.promote()

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
