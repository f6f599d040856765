"""Writes results in batches: many completions per statement, fenced per job by lease token.

A completion waits at most ``flush_interval`` (a few milliseconds) for company; a full batch goes
at once. If the database is unreachable the batch is kept and retried: a lease that runs out in
the meantime simply makes that write stale, and fencing refuses it. A write that failed may
still have committed (the connection died after COMMIT reached the server), so the retry also
asks which of its acks are already in (``applied_completions``) rather than reporting our own
committed results as stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from ..sql import Queries
from . import arrays
from .executor import Outcome, ack_params
from .state import round_failed

log = logging.getLogger("pgqueue.worker.completer")


class Completer:
    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        q: Queries,
        on_written: Callable[[list[Outcome], set[int]], None],
        *,
        flush_interval: float = 0.002,
        batch_size: int = 500,
    ) -> None:
        self.pool = pool
        self.q = q
        self.on_written = on_written
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.pending: list[Outcome] = []
        self._has_work = asyncio.Event()
        self._stopped = False
        #: The last write of the head of ``pending`` failed: it may have committed unseen.
        self._uncertain = False
        self.writes = 0

    def submit(self, outcome: Outcome) -> None:
        self.pending.append(outcome)
        self._has_work.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Flush until stopped; the final flush is ``drain``'s job. Never cancelled mid-write
        (a write that committed unseen would be resent and look stale): ``stop`` wakes it."""
        while True:
            await self._has_work.wait()
            if self._stopped or stopping.is_set():
                return
            if len(self.pending) < self.batch_size:
                await asyncio.sleep(self.flush_interval)
            await self.flush_once()

    async def flush_once(self) -> None:
        batch = self.pending[: self.batch_size]
        if not batch:
            if not self._stopped:
                self._has_work.clear()
            return
        try:
            accepted = await self._write(batch, self._uncertain or any(o.uncertain for o in batch))
        except Exception as exc:
            round_failed(log, f"writing {len(batch)} results", exc)
            self._uncertain = True
            await asyncio.sleep(0.5)
            return
        self._uncertain = False
        del self.pending[: len(batch)]
        if not self.pending and not self._stopped:
            self._has_work.clear()
        self.on_written(batch, accepted)

    async def _write(self, batch: list[Outcome], uncertain: bool) -> set[int]:
        async with self.pool.connection() as conn:
            arrays.register(conn)  # idempotent, and a few microseconds a write
            cur = await conn.execute(self.q.complete_jobs, ack_params(batch, packed=True))
            accepted = {int(row[0]) for row in await cur.fetchall()}
            self.writes += 1
            refused = [o for o in batch if o.job_id not in accepted]
            if uncertain and refused:
                cur = await conn.execute(
                    self.q.applied_completions,
                    {
                        "ids": [o.job_id for o in refused],
                        "tokens": [o.lease_token for o in refused],
                    },
                )
                accepted.update(int(row[0]) for row in await cur.fetchall())
            return accepted

    def stop(self) -> None:
        self._stopped = True
        self._has_work.set()

    async def drain(self, timeout: float) -> bool:
        """Flush everything pending (shutdown); False if the database never took it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.pending and loop.time() < deadline:
            await self.flush_once()
        return not self.pending
