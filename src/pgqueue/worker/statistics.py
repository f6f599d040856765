"""Writes this worker's per-second aggregates (counts, latency histograms) and the shared depth
sample: one small statement per second, never one per job."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from .. import stats
from .outage import Outage
from .state import pause, round_failed

log = logging.getLogger("pgqueue.worker.stats")


class StatsWriter:
    def __init__(
        self,
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]],
        recorder: stats.StatsRecorder,
        schema: str,
        *,
        retention: float = 3600.0,
        outage: Outage | None = None,
    ) -> None:
        self.pool = pool
        self.outage = outage or Outage()
        self.recorder = recorder
        self.schema = schema
        self.retention = retention

    async def write(self, rounds: int) -> None:
        async with self.pool.connection() as conn:
            await self.recorder.flush(conn)
            await stats.sample_depth(conn, self.schema)
            if rounds % 60 == 0:
                await stats.prune_stats(conn, self.schema, older_than_seconds=self.retention)

    async def run(self, stopping: asyncio.Event) -> None:
        rounds = 0
        while not stopping.is_set():
            try:
                await self.write(rounds)
                self.outage.ok()
            except Exception as exc:  # counts are kept for the next flush
                round_failed(log, "stats flush", exc, self.outage)
            rounds += 1
            await pause(stopping, 1.0)

    async def final_flush(self) -> None:
        try:
            async with self.pool.connection() as conn:
                await self.recorder.flush(conn)
        except (psycopg.Error, OSError) as exc:
            log.debug("final stats flush failed (%s)", exc)
