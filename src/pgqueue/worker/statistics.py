"""Writes this worker's per-second aggregates (counts, latency histograms) and the shared depth
sample: one small statement per second, never one per job. The depth sample is the fleet's
(one per second across workers), so each worker offers one about every second times the live
workers (``spread``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psycopg

from .. import stats
from .connections import Connections
from .outage import Outage
from .state import pause, round_failed, spread

log = logging.getLogger("pgqueue.worker.stats")


class StatsWriter:
    def __init__(
        self,
        pool: Connections,
        recorder: stats.StatsRecorder,
        schema: str,
        *,
        retention: float = 3600.0,
        outage: Outage | None = None,
        fleet: Callable[[], int] = lambda: 1,
    ) -> None:
        self.fleet = fleet
        self._sample_at = self._prune_at = 0.0
        self.pool = pool
        self.outage = outage or Outage()
        self.recorder = recorder
        self.schema = schema
        self.retention = retention

    async def write(self, rounds: int) -> None:
        now = time.monotonic()
        sample, prune = now >= self._sample_at, now >= self._prune_at
        if sample:
            self._sample_at = now + spread(1.0, self.fleet())
        if prune:
            self._prune_at = now + spread(60.0, self.fleet())
        if not (sample or prune or self.recorder.pending):
            return
        async with self.pool.connection() as conn:
            await self.recorder.flush(conn)
            if sample:
                await stats.sample_depth(conn, self.schema)
            if prune:
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
