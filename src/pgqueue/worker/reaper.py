"""Recovers jobs whose lease expired, and keeps the tables small.

Every worker runs one; there is no leader. Each worker reaps every ``interval``, whatever the
fleet's size: that is what bounds recovery (a crashed worker's jobs are claimable again within
``lease + reaper_interval``, docs/guarantees.md), and a round that finds nothing expired costs one
scan of the running jobs' partial index. Pruning, which no guarantee times, is the fleet's: each
worker prunes about every minute times the live workers, jittered (``spread``), so the fleet
prunes about once a minute whatever its size. The
reaping statement locks what it takes and
re-checks the expired lease on the newest row version (see ``reap_expired_leases``), so two
reapers, or a reaper racing a late completion, can never overwrite a job that finished or was
claimed again; it skips rows locked right now instead of waiting for them, so one stuck row
never holds up the round. Reaped jobs that will run again wake waiting workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..backoff import Backoff
from ..sql import Queries
from .connections import Connections
from .state import WorkerState, pause, round_failed, spread

log = logging.getLogger("pgqueue.worker.reaper")

PRUNE_BATCH = 10_000  # the LIMIT of prune_finished_jobs
PRUNE_ROUNDS = 100  # at most a million rows per prune, then the next round goes on


class Reaper:
    def __init__(
        self,
        pool: Connections,
        q: Queries,
        state: WorkerState,
        *,
        backoff: Backoff,
        interval: float,
        lease: float,
        retention: float | None,
        wake: Callable[[list[str]], None] = lambda queues: None,
        fleet: Callable[[], int] = lambda: 1,
    ) -> None:
        #: The live workers (the heartbeat counts them): prunes are spaced by it.
        self.fleet = fleet
        self._prune_at = 0.0  # monotonic: the first round prunes
        self.pool = pool
        self.q = q
        self.state = state
        self.backoff = backoff
        self.interval = interval
        self.lease = lease
        self.retention = retention
        self.wake = wake
        self.rounds = 0
        #: Test hook: seconds to stall between finding an expired lease and updating it.
        self.pause_for_tests = 0.0

    async def reap(self) -> int:
        params = {
            "backoff_base": self.backoff.base,
            "backoff_cap": self.backoff.cap,
            "pause": self.pause_for_tests,
        }
        async with self.pool.connection() as conn:
            cur = await conn.execute(self.q.reap_expired_leases, params)
            rows = await cur.fetchall()
            dead = [str(job_id) for job_id, status, _, _ in rows if status != "retrying"]
            if dead:  # dead or cancelled: final, and App.wait may be waiting for it
                await conn.execute(self.q.notify_finished, {"ids": ",".join(dead)})
        for job_id, status, attempts, _queue in rows:
            log.warning("job %s: lease expired on attempt %s; now %s", job_id, attempts, status)
        self.state.counters.reaped += len(rows)
        if rows:
            self.state.wakeup.set()
            # A retrying job is work again; any reaped job freed a slot of its limit groups, for
            # which other jobs of its queue may wait (concepts/limits.md).
            self.wake([str(queue) for _, _, _, queue in rows])
        return len(rows)

    async def prune(self) -> int:
        """Delete expired finished jobs in bounded batches until none are left (so a busy queue
        cannot outgrow its pruning); returns how many went. Each batch takes the connection
        anew: the heartbeat shares this lane and waits for one batch at most."""
        pruned = 0
        async with self.pool.connection() as conn:
            await conn.execute(self.q.prune_workers, {"older_than": max(60.0, 3 * self.lease)})
        if self.retention is None:
            return 0
        for _ in range(PRUNE_ROUNDS):
            async with self.pool.connection() as conn:
                cur = await conn.execute(self.q.prune_finished_jobs, {"older_than": self.retention})
            pruned += cur.rowcount
            if cur.rowcount < PRUNE_BATCH:
                break
        return pruned

    def prune_every(self) -> float:
        """Seconds between the fleet's prunes: once a minute, or twice per retention if
        shorter (never below the reaper's interval)."""
        seconds = 60.0 if self.retention is None else min(60.0, self.retention / 2)
        return max(seconds, self.interval)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.reap()
                now = time.monotonic()
                if now >= self._prune_at:
                    self._prune_at = now + spread(self.prune_every(), self.fleet())
                    await self.prune()
            except Exception as exc:
                round_failed(log, "reaper round", exc)
            self.rounds += 1
            await pause(stopping, self.interval)
