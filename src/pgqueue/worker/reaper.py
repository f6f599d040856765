"""Recovers jobs whose lease expired, and keeps the tables small.

Finished jobs past their retention leave ``pgqueue_jobs`` in batches of ``batch`` rows, each
its own short statement, for at most ``PRUNE_BUDGET`` seconds per prune: deleted, or moved to
``pgqueue_jobs_archive`` with ``archive``. Succeeded and cancelled jobs follow ``retention``,
dead ones ``dead_retention`` (None: kept until requeued or deleted). Rate logs whose entries all
left their period go too (``prune_rates``), so per-key rates keep no row per key gone quiet.

Every worker runs one; there is no leader. Each worker reaps every ``interval``, whatever the
fleet's size: that is what bounds recovery (a crashed worker's jobs are claimable again within
``lease + reaper_interval``, docs/guarantees.md), and a round that finds nothing expired costs one
scan of the running jobs' partial index. Pruning, which no guarantee times, is the fleet's: each
worker prunes about every minute times the live workers, jittered (``spread``), so the fleet
prunes about once a minute whatever its size; a prune runs beside the reaping rounds, which
wait for one of its batches at most. The reaping statement locks what it takes and
re-checks the expired lease on the newest row version (see ``reap_expired_leases``), so two
reapers, or a reaper racing a late completion, can never overwrite a job that finished or was
claimed again; it skips rows locked right now instead of waiting for them, so one stuck row
never holds up the round. Reaped jobs that will run again wake waiting workers.

A row stays locked, and so unreaped, for as long as the transaction that locked it lives, and a
worker cut off from the server in the middle of one leaves it open until TCP gives up on the
worker (hours, with the server's default keepalives). So each round first ends the sessions that
workers whose lease ran out left waiting inside a transaction (``end_lapsed_sessions``; their
writes would be fenced anyway), and reaps after they have had ``ENDED_SETTLE`` to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg

from ..backoff import Backoff
from ..sql import Queries
from .connections import Connections
from .state import WorkerState, pause, round_failed, spread

log = logging.getLogger("pgqueue.worker.reaper")

PRUNE_BATCH = 10_000  # rows per statement: 60-100 ms each beside 10 million finished rows
PRUNE_BUDGET = 10.0  # seconds of batches per prune; the rest waits for the next prune
#: Seconds a round waits, after ending lapsed workers' sessions, for them to exit (and release
#: their locks) before it reaps.
ENDED_SETTLE = 0.2


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
        dead_retention: float | None = None,
        archive: bool = False,
        archive_retention: float | None = None,
        batch: int = PRUNE_BATCH,
        wake: Callable[[list[str]], None] = lambda queues: None,
        fleet: Callable[[], int] = lambda: 1,
        worker_id: UUID | None = None,
    ) -> None:
        #: This reaper's worker: its own sessions are never ended (its heartbeat sees its lease).
        self.worker_id = worker_id
        #: Sessions of lapsed workers ended so far.
        self.ended = 0
        #: False once the server said this role may not end them (logged once).
        self._may_end = True
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
        self.dead_retention = dead_retention
        self.archive = archive
        self.archive_retention = archive_retention
        self.batch = batch
        self.wake = wake
        self.rounds = 0
        self.prunes = 0
        #: Test hook: seconds to stall between finding an expired lease and updating it.
        self.pause_for_tests = 0.0

    async def reap(self) -> int:
        params = {
            "backoff_base": self.backoff.base,
            "backoff_cap": self.backoff.cap,
            "pause": self.pause_for_tests,
        }
        if await self.end_lapsed_sessions():
            await asyncio.sleep(ENDED_SETTLE)
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

    async def end_lapsed_sessions(self) -> int:
        """End the sessions that workers whose lease ran out left waiting inside a transaction
        (see the module docstring); how many."""
        if not self._may_end:
            return 0
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(self.q.end_lapsed_sessions, {"worker_id": self.worker_id})
                row = await cur.fetchone()
        except psycopg.errors.InsufficientPrivilege as exc:
            self._may_end = False
            log.warning(
                "cannot end the sessions of workers whose lease ran out (%s); rows such a "
                "session holds are reaped once the server drops it", exc,
            )  # fmt: skip
            return 0
        ended = int(row[0]) if row else 0
        if ended:
            self.ended += ended
            log.warning(
                "ended %d session(s) of workers whose lease ran out, left waiting inside a "
                "transaction (a worker cut off from the server)", ended,
            )  # fmt: skip
        return ended

    async def prune(self) -> int:
        """Remove (or archive) finished jobs past their retention in batches until none are left
        or the prune's time budget is spent; returns how many went. Each batch is a statement
        of its own in autocommit, so no transaction outlives one batch and no lock is held
        between batches; each takes the connection anew, so the heartbeat, which shares this
        lane, waits for one batch at most."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PRUNE_BUDGET
        q = self.q
        passes: list[tuple[bytes, float | None, dict[str, Any]]] = []
        if self.archive:
            keep = self.archive_retention
            if keep is not None:  # what the archive would drop at once is not moved there
                passes += [
                    (q.prune_finished_jobs, _longer(self.retention, keep), {}),
                    (q.prune_dead_jobs, _longer(self.dead_retention, keep), {}),
                ]
            passes += [
                (q.archive_finished_jobs, self.retention, {"keep_seconds": keep}),
                (q.archive_dead_jobs, self.dead_retention, {"keep_seconds": keep}),
            ]
        else:
            passes += [
                (q.prune_finished_jobs, self.retention, {}),
                (q.prune_dead_jobs, self.dead_retention, {}),
            ]
        pruned = 0
        async with self.pool.connection() as conn:
            await conn.execute(q.prune_workers, {"older_than": max(60.0, 3 * self.lease)})
            if self.archive:
                await conn.execute(
                    q.archive_partitions,
                    {
                        "keep_seconds": self.archive_retention,
                        "with_dead": self.dead_retention is not None,
                    },
                )
        for statement, older_than, extra in passes:
            if older_than is None:
                continue
            params = {"older_than": older_than, "batch": self.batch, **extra}
            while True:
                async with self.pool.connection() as conn:
                    cur = await conn.execute(statement, params)
                pruned += cur.rowcount
                if cur.rowcount < self.batch or loop.time() >= deadline:
                    break
        while loop.time() < deadline:  # rate logs of groups gone quiet (not counted: no jobs)
            async with self.pool.connection() as conn:
                cur = await conn.execute(q.prune_rates, {"batch": self.batch})
            if cur.rowcount < self.batch:
                break
        return pruned

    def prune_every(self) -> float:
        """Seconds between the fleet's prunes: once a minute, or twice per retention if
        shorter (never below the reaper's interval)."""
        kept = [r for r in (self.retention, self.dead_retention) if r is not None]
        seconds = min([60.0, *(r / 2 for r in kept)])
        return max(seconds, self.interval)

    async def run(self, stopping: asyncio.Event) -> None:
        """Reaps every ``interval``; a prune runs beside the rounds, one at a time, so that a
        prune's batches (up to PRUNE_BUDGET seconds of them) never hold back a reap longer
        than one batch: recovery within ``lease + interval`` does not wait for history."""
        pruning: asyncio.Task[None] | None = None
        try:
            while not stopping.is_set():
                try:
                    await self.reap()
                    self.state.outage.ok()
                except Exception as exc:
                    round_failed(log, "reaper round", exc, self.state.outage)
                now = time.monotonic()
                if (pruning is None or pruning.done()) and now >= self._prune_at:
                    self._prune_at = now + spread(self.prune_every(), self.fleet())
                    pruning = asyncio.create_task(self._prune_round(), name="pgqueue-prune")
                self.rounds += 1
                await pause(stopping, self.interval)
        finally:
            if pruning is not None and not pruning.done():
                pruning.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pruning

    async def _prune_round(self) -> None:
        try:
            await self.prune()
        except Exception as exc:
            round_failed(log, "prune", exc, self.state.outage)
        self.prunes += 1


def _longer(retention: float | None, keep: float) -> float | None:
    """When a job is deleted rather than archived: past both its retention and the archive's."""
    return None if retention is None else max(retention, keep)
