"""The claim loop: never claims more jobs than there are free slots.

It claims when woken (a NOTIFY, a freed slot after a full batch, a reaped job) and on every poll
tick, which is the correctness path: a lost notification costs at most one poll interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from ..sql import Queries
from .state import ClaimedJob, WorkerState, pause, round_failed

log = logging.getLogger("pgqueue.worker.fetcher")


class Fetcher:
    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        q: Queries,
        state: WorkerState,
        *,
        worker_id: UUID,
        queues: list[str] | None,
        lease: float,
        poll_interval: float,
        start: Callable[[ClaimedJob], None],
    ) -> None:
        self.pool = pool
        self.state = state
        self.worker_id = worker_id
        self.queues = queues
        self.lease = lease
        self.poll_interval = poll_interval
        self.start = start
        self.statement = q.claim_jobs if queues is None else q.claim_jobs_in_queues
        self.claims = 0

    async def claim(self, limit: int) -> list[ClaimedJob]:
        params: dict[str, Any] = {"lease": self.lease, "worker_id": self.worker_id, "limit": limit}
        if self.queues is not None:
            params["queues"] = self.queues
        async with self.pool.connection() as conn:
            cur = await conn.execute(self.statement, params)
            rows = await cur.fetchall()
        self.claims += 1
        return [ClaimedJob(*row) for row in rows]

    async def run(self, stopping: asyncio.Event) -> None:
        state = self.state
        maybe_more = True
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + self.poll_interval
        failures = 0
        while not stopping.is_set():
            free = state.free_slots
            if free and maybe_more:
                state.wakeup.clear()
                try:
                    jobs = await self.claim(free)
                    failures = 0
                except Exception as exc:
                    failures += 1
                    round_failed(log, "claim", exc)
                    await pause(stopping, min(0.1 * 2**failures, self.poll_interval * 5))
                    continue
                if stopping.is_set():
                    # Claimed during shutdown: give them straight back through the runtime.
                    for job in jobs:
                        self.start(job)
                    return
                for job in jobs:
                    self.start(job)
                maybe_more = len(jobs) == free
                continue
            timeout = max(next_poll - loop.time(), 0.0)
            woke = await self._wait(stopping, timeout)
            if not woke or loop.time() >= next_poll:
                next_poll = loop.time() + self.poll_interval
                maybe_more = True
            elif woke and state.free_slots:
                # Woken by a notification, a freed slot or a reaped job: look again.
                maybe_more = maybe_more or self._notified
            self._notified = False

    _notified = False

    def notify(self) -> None:
        """Called by the notifier: there is new work in a queue we serve."""
        self._notified = True
        self.state.wakeup.set()

    async def _wait(self, stopping: asyncio.Event, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.state.wakeup.wait(), timeout)
        except TimeoutError:
            return False
        self.state.wakeup.clear()
        return not stopping.is_set()
