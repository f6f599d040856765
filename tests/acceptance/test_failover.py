"""A primary failover under load: a primary and a streaming standby (tests/replication.py),
producers and two worker processes connected by one multi-host DSN
(``host=a,b target_session_attrs=read-write``), the primary killed (``pg_ctl -m immediate stop``)
and the standby promoted.

Producers and workers must carry on by themselves: no process dies, no traceback, one warning
per worker for the outage and one when it is over, LISTEN again on the new primary, and every
job that exists on it ends in a final state. With synchronous replication no enqueue that
returned is lost and no transactional effect is written twice. With asynchronous replication
the loss is measured against the replication lag at the crash, and printed
(docs/failover.md has the figures).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue import DatabaseUnavailableError
from pgqueue.migrate import migrate
from tests.acceptance import failover_app
from tests.helpers import WorkerProcesses, wait_until
from tests.replication import Replicated

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

APP = "tests.acceptance.failover_app:app"
Conn = psycopg.Connection[tuple[Any, ...]]
#: The workers' LISTEN sessions on a server.
LISTENING = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgqueue-worker:%%:listen'"
)


@dataclass
class Producers:
    """Threads enqueueing until ``stop``: three with ``enqueue``, one with ``enqueue_async``.
    ``acked`` holds the token of every call that returned; ``failed`` every error."""

    app: pgqueue.App
    stop: threading.Event = field(default_factory=threading.Event)
    acked: list[str] = field(default_factory=list)
    failed: list[BaseException] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for name in ("a", "b", "c"):
            self.threads.append(threading.Thread(target=self._sync, args=(name,)))
        self.threads.append(threading.Thread(target=lambda: asyncio.run(self._async("z"))))
        for thread in self.threads:
            thread.start()

    def check(self) -> bool:
        """Raise the first error that is not a lost answer (never expected here)."""
        for error in self.failed:
            if not (isinstance(error, DatabaseUnavailableError) and error.uncertain):
                raise error
        return True

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)
        assert not any(t.is_alive() for t in self.threads), "a producer hangs"

    @staticmethod
    def _job(token: str, i: int) -> str:
        return "effect" if i % 2 else "note"

    def _sync(self, name: str) -> None:
        i = 0
        while not self.stop.is_set():
            token = f"{name}{i}"
            try:
                self.app.enqueue(self._job(token, i), {"token": token}, allow_unknown=True)
                self.acked.append(token)
            except Exception as exc:
                self.failed.append(exc)
            i += 1
            time.sleep(0.002)

    async def _async(self, name: str) -> None:
        i = 0
        while not self.stop.is_set():
            token = f"{name}{i}"
            try:
                await self.app.enqueue_async(
                    self._job(token, i), {"token": token}, allow_unknown=True
                )
                self.acked.append(token)
            except Exception as exc:
                self.failed.append(exc)
            i += 1
            await asyncio.sleep(0.002)
        await self.app.aclose()


def scalar(conn: Conn, query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def setup(replicated: Replicated, tmp_path: Path) -> Iterator[tuple[Replicated, WorkerProcesses]]:
    with psycopg.connect(replicated.primary.dsn, autocommit=True) as conn:
        migrate(conn, "public")
        conn.execute(failover_app.INSTALL)
    workers = WorkerProcesses(replicated.dsn, APP, tmp_path)
    try:
        yield replicated, workers
    finally:
        workers.stop_all(30)
        print(workers.output())


@pytest.mark.parametrize(
    ("replication", "shutdown"),
    [("synchronous", "immediate"), ("asynchronous", "immediate"), ("asynchronous", "fast")],
)
def test_producers_and_workers_ride_out_a_failover(
    setup: tuple[Replicated, WorkerProcesses], replication: str, shutdown: str
) -> None:
    """``immediate``: the primary crashes. ``fast``: a planned switchover, where every session
    ends with 57P01 (admin shutdown) and no committed transaction is lost, even asynchronous."""
    pair, workers = setup
    if replication == "synchronous":
        pair.synchronous()
    for _ in range(2):
        workers.start("--concurrency", "4", "--lease", "10")
    with psycopg.connect(pair.primary.dsn, autocommit=True) as old:
        # Both running before the crash (a worker that starts during an outage exits).
        wait_until(lambda: scalar(old, LISTENING) == 2, timeout=60, what="both workers LISTEN")
    producers = Producers(pgqueue.App(pair.dsn, reconnect_timeout=60))
    producers.start()
    try:
        with psycopg.connect(pair.primary.dsn, autocommit=True) as old:
            wait_until(
                lambda: (
                    scalar(old, "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'")
                    >= 300
                ),
                timeout=60,
                what="300 jobs done before the failover",
            )
        acked_before = len(producers.acked)
        lag = pair.lag_bytes()
        crashed = time.monotonic()
        pair.fail_over(shutdown)
        promoted = time.monotonic() - crashed
        # Producers recover by themselves: calls go through again on the new primary.
        wait_until(
            lambda: producers.check() and len(producers.acked) >= acked_before + 300,
            timeout=60,
            what="300 more enqueues after the failover",
        )
        recovered = time.monotonic() - crashed
    finally:
        producers.join()
        producers.app.close()

    producers.check()
    acked = set(producers.acked)
    with psycopg.connect(pair.standby.dsn, autocommit=True) as new:
        # Every job on the new primary ends in a final state (none stuck under a lease).
        wait_until(
            lambda: (
                scalar(
                    new,
                    "SELECT count(*) FROM pgqueue_jobs WHERE status IN ('queued', 'running', 'retrying')",
                )
                == 0
            ),
            timeout=90,
            what="every job finished on the new primary",
        )
        rows = new.execute("SELECT args->>'token', task, status FROM pgqueue_jobs").fetchall()
        present = {token for token, _, _ in rows}
        lost = acked - present
        assert {status for _, _, status in rows} == {"succeeded"}
        # Transactional completion: one effect per succeeded job, never two.
        effects: dict[str, int] = dict(
            new.execute("SELECT token, count(*) FROM failover_effects GROUP BY token").fetchall()
        )
        expected = {token for token, task, _ in rows if task == "effect"}
        assert set(effects) == expected
        assert max(effects.values()) == 1
        # LISTEN again, on the new primary.
        wait_until(
            lambda: scalar(new, LISTENING) == 2,
            timeout=30,
            what="both workers LISTEN on the new primary",
        )

    print(
        f"\nFAILOVER replication={replication} shutdown={shutdown} lag_at_crash={lag} bytes"
        f" acked={len(acked)} lost={len(lost)} uncertain={len(producers.failed)}"
        f" promoted_in={promoted:.1f}s producers_back_in={recovered:.1f}s"
    )
    if replication == "synchronous" or shutdown == "fast":
        assert lost == set()

    # No worker crashed, nor logged a traceback; each said once that PostgreSQL was gone and once
    # that it was back.
    assert all(proc.poll() is None for proc in workers.procs)
    workers.stop_all(30)
    for log in workers.logs:
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text
        assert len(re.findall("PostgreSQL is unreachable", text)) == 1, text
        assert len(re.findall("PostgreSQL is reachable again", text)) == 1, text
