"""A primary and a hot standby streaming from it, both throwaway clusters from the local
PostgreSQL binaries: for what must work against a read replica (the dashboard) and, by killing
the primary and promoting the standby, for failover (synchronous replication or asynchronous).

As root every binary runs as the ``postgres`` user, as ``EmbeddedPostgres`` does: initdb,
pg_basebackup and the servers refuse root.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import conninfo

from pgqueue.embedded import EmbeddedPostgres
from tests.helpers import wait_until


class DelayProxy:
    """A TCP relay on a port of its own that hands every chunk of bytes on ``delay`` seconds
    after it arrived, both ways: a replication link with network latency, so that an
    asynchronous standby lags behind its primary as it would across a network."""

    def __init__(self, port: int, delay: float) -> None:
        self.target = port
        self.delay = delay
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        due: list[tuple[float, int, bytes]] = []
        lock = threading.Condition()
        order = itertools.count()
        done = threading.Event()

        def send() -> None:
            while True:
                with lock:
                    while not due and not done.is_set():
                        lock.wait()
                    if not due:
                        break
                    at, _, data = due[0]
                    wait = at - time.monotonic()
                    if wait > 0:
                        lock.wait(wait)
                        continue
                    heapq.heappop(due)
                if self.closed:
                    break
                try:
                    dst.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            with lock:
                if not data:
                    done.set()
                else:
                    heapq.heappush(due, (time.monotonic() + self.delay, next(order), data))
                lock.notify()
            if not data:
                return

    def close(self) -> None:
        """Cut the link: what is still on its way is dropped, as when a machine goes down."""
        self.closed = True
        self.server.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class Standby(EmbeddedPostgres):
    """A hot standby of ``primary``: ``pg_basebackup -R`` (a base backup with
    ``standby.signal`` and ``primary_conninfo``) into a data directory of its own, started on
    its own port. ``hot_standby`` is on by default, so it takes read-only connections.
    ``via``: the port to reach the primary on (a ``DelayProxy``'s), else the primary's own."""

    def __init__(self, primary: EmbeddedPostgres, via: int | None = None) -> None:
        # initdb may be a symlink on PATH (/usr/local/bin) to a directory that also holds
        # pg_basebackup: follow it.
        super().__init__(bindir=(primary.bindir / "initdb").resolve().parent)
        self.primary = primary
        self.via = via or primary.port

    def start(self) -> Standby:
        # The primary's default pg_hba.conf (initdb --auth=trust) admits replication from
        # 127.0.0.1, and wal_level=replica with 10 WAL senders is PostgreSQL's default.
        source = f"host=127.0.0.1 port={self.via} user={self.primary.user}"
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
    link: DelayProxy | None = None

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
        return self.lag()[0]

    def lag(self) -> tuple[int, float]:
        """(bytes, seconds): WAL the primary has written that the standby has not flushed yet,
        and the standby's last reported flush lag (0 when it is caught up)."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)::bigint,"
                " coalesce(extract(epoch FROM flush_lag), 0)::float8 FROM pg_stat_replication"
            ).fetchone()
        assert row is not None
        return int(row[0]), float(row[1])

    def fail_over(self, shutdown: str = "immediate") -> None:
        """The primary crashes (``pg_ctl -m immediate stop``: no shutdown checkpoint, every
        session cut) and the standby is promoted. With a delayed link, the link goes down
        first, with the WAL still on its way on it, as when the primary's machine is lost.
        ``shutdown="fast"``: a planned switchover instead (sessions end with 57P01, and the
        primary sends the standby all its WAL before it stops)."""
        if self.link is not None and shutdown == "immediate":
            self.link.close()
        self.primary.stop_server(shutdown)
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
def replicated(delay: float = 0.0) -> Iterator[Replicated]:
    """A fresh primary and a hot standby streaming from it; both removed afterwards.
    ``delay``: seconds each way on the replication link (a ``DelayProxy``)."""
    primary = EmbeddedPostgres()
    proxy: DelayProxy | None = None
    try:
        primary.start()
        if delay:
            proxy = DelayProxy(primary.port, delay)
        standby = Standby(primary, via=proxy.port if proxy else None)
        try:
            yield Replicated(primary, standby.start(), proxy)
        finally:
            standby.stop()
    finally:
        if proxy is not None and not proxy.closed:
            proxy.close()
        primary.stop()
