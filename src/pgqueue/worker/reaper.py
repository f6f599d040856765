"""Recovers jobs whose lease expired, and keeps the tables small.

Every worker runs one; there is no leader. The reaping statement is guarded on the expired lease
itself (see ``reap_expired_leases``), so two reapers, or a reaper racing a late completion, can
never overwrite a job that finished or was claimed again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from ..backoff import Backoff
from ..sql import Queries
from .state import WorkerState, pause, round_failed

log = logging.getLogger("pgqueue.worker.reaper")

PRUNE_BATCH = 10_000  # the LIMIT of prune_finished_jobs
PRUNE_ROUNDS = 100  # at most a million rows per prune, then the next round goes on
LOCK_WAIT_MS = 500  # an ack commits within milliseconds; longer means its holder stalled


class Reaper:
    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        q: Queries,
        state: WorkerState,
        *,
        backoff: Backoff,
        interval: float,
        lease: float,
        retention: float | None,
    ) -> None:
        self.pool = pool
        self.q = q
        self.state = state
        self.backoff = backoff
        self.interval = interval
        self.lease = lease
        self.retention = retention
        self.rounds = 0
        #: Test hook: seconds to stall between finding an expired lease and updating it.
        self.pause_for_tests = 0.0
        #: Rounds that gave up waiting on a row lock and reaped around it.
        self.lock_waits = 0

    async def reap(self) -> int:
        params = {
            "backoff_base": self.backoff.base,
            "backoff_cap": self.backoff.cap,
            "pause": self.pause_for_tests,
        }
        async with self.pool.connection() as conn:
            try:
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL lock_timeout = {LOCK_WAIT_MS}")
                    cur = await conn.execute(self.q.reap_expired_leases, params)
                    rows = await cur.fetchall()
            except psycopg.errors.LockNotAvailable:
                # A holder sits between its ack and its COMMIT: reap around it.
                self.lock_waits += 1
                cur = await conn.execute(self.q.reap_expired_leases_skip_locked, params)
                rows = await cur.fetchall()
        for job_id, status, attempts in rows:
            log.warning("job %s: lease expired on attempt %s; now %s", job_id, attempts, status)
        self.state.counters.reaped += len(rows)
        if rows:
            self.state.wakeup.set()
        return len(rows)

    async def prune(self) -> int:
        """Delete expired finished jobs in bounded batches until none are left (so a busy queue
        cannot outgrow its pruning); returns how many went."""
        pruned = 0
        async with self.pool.connection() as conn:
            await conn.execute(self.q.prune_workers, {"older_than": max(60.0, 3 * self.lease)})
            if self.retention is None:
                return 0
            for _ in range(PRUNE_ROUNDS):
                cur = await conn.execute(self.q.prune_finished_jobs, {"older_than": self.retention})
                pruned += cur.rowcount
                if cur.rowcount < PRUNE_BATCH:
                    break
        return pruned

    def prune_every(self) -> int:
        """Reaper rounds between prunes: once a minute, or twice per retention if shorter."""
        seconds = 60.0 if self.retention is None else min(60.0, self.retention / 2)
        return max(int(seconds / self.interval), 1)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.reap()
                if self.rounds % self.prune_every() == 0:
                    await self.prune()
            except Exception as exc:
                round_failed(log, "reaper round", exc)
            self.rounds += 1
            await pause(stopping, self.interval)
