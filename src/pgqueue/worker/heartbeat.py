"""Extends every lease this worker holds in one statement per interval, on its own connection
(so a busy pool never delays it), and refreshes the worker's row in ``pgqueue_workers``.

A job missing from the statement's result is no longer ours (reaped or cancelled): its handler
is cancelled locally. If heartbeats cannot reach the database, handlers whose lease has surely
run out by now (judged conservatively on the monotonic clock) are abandoned as well.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg

from ..sql import Queries
from .state import Held, Phase, WorkerState, pause, round_failed

log = logging.getLogger("pgqueue.worker.heartbeat")

# Jobs whose lease can be lost before anything was written: prefetched or running.
_WAITING_OR_RUNNING = (Phase.PREFETCHED, Phase.RUNNING)


class Heartbeat:
    def __init__(
        self,
        dsn: str,
        q: Queries,
        state: WorkerState,
        *,
        worker_id: UUID,
        queues: list[str] | None,
        lease: float,
        interval: float,
        on_lost: Callable[[Held], None],
        connect_kwargs: dict[str, Any],
    ) -> None:
        self.dsn = dsn
        self.q = q
        self.state = state
        self.worker_id = worker_id
        self.queues = queues
        self.lease = lease
        self.interval = interval
        self.on_lost = on_lost
        self.connect_kwargs = connect_kwargs
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self._connecting = asyncio.Lock()
        self.beats = 0

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        # Two beats at once (the service's and one forced, as tests do) must not both connect:
        # the connection the first stored would be dropped unclosed.
        async with self._connecting:
            if self.conn is None or self.conn.closed or self.conn.broken:
                self.conn = await psycopg.AsyncConnection.connect(self.dsn, **self.connect_kwargs)
            return self.conn

    async def beat(self) -> None:
        held = [h for h in self.state.held.values() if h.phase is not Phase.ABANDONED]
        sent_at = time.monotonic()
        stale = self.state.counters.stale_unreported
        params = {
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queues": self.queues,
            "concurrency": self.state.concurrency,
            "stale_writes": stale,
            "lease": self.lease,
            "ids": [h.job.id for h in held],
            "tokens": [h.job.lease_token for h in held],
        }
        conn = await self._connection()
        cur = await conn.execute(self.q.extend_leases, params)
        kept = {int(row[0]) for row in await cur.fetchall()}
        self.state.counters.stale_unreported -= stale
        self.beats += 1
        for h in held:
            if h.job.id in kept:
                h.lease_deadline = sent_at + self.lease
            elif self.state.held.get(h.job.id) is h and h.phase in _WAITING_OR_RUNNING:
                log.warning("job %d: lease lost (reaped or cancelled); abandoning it", h.job.id)
                self.on_lost(h)

    def abandon_expired(self) -> None:
        now = time.monotonic()
        for h in list(self.state.held.values()):
            if h.phase in _WAITING_OR_RUNNING and now >= h.lease_deadline:
                log.warning("job %d: lease ran out while the database was unreachable", h.job.id)
                self.on_lost(h)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                # Bounded, connecting included: a blackholed connection must not stall the
                # loop, or handlers would outlive their leases unnoticed.
                await asyncio.wait_for(self.beat(), self.interval)
            except Exception as exc:
                round_failed(log, "heartbeat", exc)
                if self.conn is not None:
                    await self.conn.close()
                    self.conn = None
            self.abandon_expired()
            await pause(stopping, self.interval)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
