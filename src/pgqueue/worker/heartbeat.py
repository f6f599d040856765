"""Keeps the worker's lease alive: one statement per interval, whatever the worker holds, on a
lane of its own of the worker's connections (its own connection unless the budget is tight;
then the first one that comes free, ahead of the other lanes: it waits for one short statement
at most). Each beat also
counts the live workers, from which the worker's connection budget and the spacing of the
fleet-wide chores follow (``connections.share``, ``state.spread``); while that count changes
from one look to the next (workers starting or stopping), it is taken again every
``FLEET_SETTLE`` seconds until it holds still.

One lease covers every job the worker holds (``pgqueue_workers.lease_expires_at``, migration
0005): the heartbeat writes that one row and only reads job rows, so it never waits on a job's
row lock (an operator's ``SELECT ... FOR UPDATE``, a handler's transaction committing its ack)
and never conflicts with a handler's own transaction, whatever its isolation level.

The lease is judged on this side too. Each successful heartbeat moves ``WorkerState.
lease_deadline`` to when it was sent plus the lease, which is no later than the database's own
expiry; a timer at that deadline abandons every job the worker has not finished (running
handlers are cancelled, prefetched jobs dropped), so a handler of a worker that cannot reach the
database stops when its lease has run out, before any reaper can hand the job to someone else,
as long as the event loop runs (a stalled loop runs nothing, timers included).

A job missing from the database's answer is no longer ours (reaped or taken by hand): its
handler is cancelled. Jobs abandoned when the lease ran out may still be the worker's in the
database (no reaper got there before the heartbeat came back): the next successful heartbeat
expires their leases, so that the reaper records those attempts as failed. And every
``UNTRACKED_EVERY`` seconds the heartbeat asks for jobs running under this worker's lease that it
does not track at all; seen so twice running, they are expired too. Besides a bug, a failover to
a standby that asynchronous replication left behind makes such jobs: their claim reached the new
primary, the ack this worker committed on the old one did not, and this worker's lease, which it
keeps extending, covers them. So after an outage the next two successful heartbeats look, and
those jobs run again within two heartbeat intervals instead of a minute or two.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg

from ..logcontext import job_fields
from ..sql import Queries
from .connections import Connections
from .state import Held, Key, Phase, WorkerState, key_of, pause, round_failed

log = logging.getLogger("pgqueue.worker.heartbeat")

# Jobs whose lease can be lost before anything was written: prefetched or running.
_WAITING_OR_RUNNING = (Phase.PREFETCHED, Phase.RUNNING)

#: Seconds between looks for jobs held in the database but not tracked (see the docstring).
UNTRACKED_EVERY = 60.0
#: Seconds between counts of the fleet while it changes (see run).
FLEET_SETTLE = 1.0


class Heartbeat:
    def __init__(
        self,
        pool: Connections,
        q: Queries,
        state: WorkerState,
        *,
        worker_id: UUID,
        queues: list[str] | None,
        lease: float,
        interval: float,
        on_lost: Callable[[Held], None],
        on_cancel: Callable[[Held], None] = lambda held: None,
        on_beat: Callable[[], None] = lambda: None,
        on_fleet: Callable[[int, int, int, int], None] = lambda *fleet: None,
    ) -> None:
        self.pool = pool
        self.q = q
        self.state = state
        self.worker_id = worker_id
        self.queues = queues
        self.lease = lease
        self.interval = interval
        self.on_lost = on_lost
        self.on_cancel = on_cancel
        #: Called whenever the database extended the lease (the worker's liveness; see health).
        self.on_beat = on_beat
        #: Called with the live workers, max_connections, the slots reserved for superusers and
        #: the client connections open now.
        self.on_fleet = on_fleet
        #: The live workers at the last count, and whether that count differed from the one
        #: before (a worker that just started counts again soon: see run).
        self._fleet_seen = -1
        self.fleet_changing = True
        self._timer: asyncio.TimerHandle | None = None
        #: Jobs abandoned when the lease ran out, to expire once the database is back.
        self._abandoned: set[Key] = set()
        #: Untracked jobs seen by the previous look (see the module docstring), and when.
        self._untracked: set[Key] = set()
        self._untracked_at = 0.0
        #: Successful beats that look for untracked jobs whatever UNTRACKED_EVERY says (after
        #: an outage: see the module docstring).
        self._look_soon = 0
        #: The last recovery from an outage (Outage.recovered_at) that scheduled those looks.
        self._recovery_seen = -math.inf
        self.beats = 0

    def extended(self, sent_at: float) -> None:
        """The database extended the lease by a statement sent at ``sent_at`` (monotonic):
        move the local deadline and the timer that acts on it."""
        state = self.state
        self.on_beat()
        state.lease_deadline = max(state.lease_deadline, sent_at + self.lease)
        if self._timer is not None:
            self._timer.cancel()
        delay = max(state.lease_deadline - time.monotonic(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._lease_ran_out)

    def _lease_ran_out(self) -> None:
        self._timer = None
        if time.monotonic() < self.state.lease_deadline:  # extended meanwhile
            return
        abandoned = [h for h in self.state.held.values() if h.phase in _WAITING_OR_RUNNING]
        if abandoned:
            log.warning(
                "the worker's lease ran out before a heartbeat could extend it (the database "
                "was unreachable or the process stalled); abandoning %d jobs",
                len(abandoned),
            )
        for h in abandoned:
            self._abandoned.add(h.job.key)
            self.on_lost(h)

    async def _save_progress(self, conn: psycopg.AsyncConnection[Any], held: list[Held]) -> None:
        """Write the progress handlers reported since the last beat (save_progress); a value
        replaced meanwhile, or not written (its row locked), waits for the next beat."""
        sent = [(h.job, h.job.progress) for h in held if h.job.progress is not None]
        if not sent:
            return
        cur = await conn.execute(
            self.q.save_progress,
            {
                "ids": [job.id for job, _ in sent],
                "tokens": [job.lease_token for job, _ in sent],
                "progress": [text for _, text in sent],
            },
        )
        written = {int(row[0]) for row in await cur.fetchall()}
        for job, text in sent:
            if job.id in written and job.progress is text:
                job.progress = None

    async def beat(self) -> None:
        state = self.state
        held = [h for h in state.held.values() if h.phase is not Phase.ABANDONED]
        sent_at = time.monotonic()
        stale = state.counters.stale_unreported
        params = {
            "worker_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queues": self.queues,
            "concurrency": state.concurrency,
            "stale_writes": stale,
            "lease": self.lease,
            "ids": [h.job.id for h in held],
            "tokens": [h.job.lease_token for h in held],
        }
        async with self.pool.connection() as conn:
            await self._beat(conn, held, sent_at, stale, params)

    async def look_at_fleet(self, conn: psycopg.AsyncConnection[Any]) -> None:
        cur = await conn.execute(self.q.worker_fleet)
        row = await cur.fetchone()
        if row is not None:
            workers = int(row[0])
            self.fleet_changing = workers != self._fleet_seen
            self._fleet_seen = workers
            self.on_fleet(workers, int(row[1]), int(row[2]), int(row[3]))

    async def _beat(
        self,
        conn: psycopg.AsyncConnection[Any],
        held: list[Held],
        sent_at: float,
        stale: int,
        params: dict[str, Any],
    ) -> None:
        state = self.state
        cur = await conn.execute(self.q.extend_leases, params)
        lost = await cur.fetchall()
        state.counters.stale_unreported -= stale
        self.beats += 1
        self.extended(sent_at)
        for job_id, token, ours in lost:
            h = state.held.get(key_of(int(job_id), token))
            if h is not None and ours:
                self.on_cancel(h)  # still ours, but someone asked to cancel it
            elif h is not None and h.phase in _WAITING_OR_RUNNING:
                log.warning(
                    "job %d: lease lost (reaped or taken over); abandoning it", job_id,
                    extra=job_fields(h.job),
                )  # fmt: skip
                self.on_lost(h)
        await self._save_progress(conn, held)
        if self._abandoned:
            # Those whose handler has ended (a cancelled handler may take a moment).
            gone = self._abandoned - state.held.keys()
            self._abandoned -= gone
            await self._give_up(conn, sorted(gone), "abandoned when the worker's lease ran out")
        if self._look_soon or sent_at - self._untracked_at >= UNTRACKED_EVERY:
            self._untracked_at = sent_at
            after_outage = self._look_soon > 0
            self._look_soon = max(self._look_soon - 1, 0)
            await self._look_for_untracked(conn, held, after_outage)

    async def _look_for_untracked(
        self, conn: psycopg.AsyncConnection[Any], held: list[Held], after_outage: bool = False
    ) -> None:
        cur = await conn.execute(
            self.q.untracked_jobs,
            {
                "worker_id": self.worker_id,
                "ids": [h.job.id for h in held],
                "tokens": [h.job.lease_token for h in held],
            },
        )
        untracked = {key_of(int(job_id), token) for job_id, token in await cur.fetchall()}
        # Twice running: a claim or an ack on its way during one look is settled by the next.
        keys = sorted((untracked & self._untracked) - self.state.held.keys())
        self._untracked = untracked - set(keys)
        if keys:
            if after_outage:  # expected: a claim or an ack whose answer the outage lost
                why = (
                    "running under this worker's lease, but untracked after the database was "
                    "unreachable (a claim whose answer was lost, or an ack lost in a failover)"
                )
                await self._give_up(conn, keys, why, level=logging.WARNING)
            else:
                await self._give_up(conn, keys, "running under this worker's lease, but untracked")

    async def _give_up(
        self, conn: psycopg.AsyncConnection[Any], keys: list[Key], why: str,
        level: int = logging.ERROR,
    ) -> None:  # fmt: skip
        """End these attempts' leases: the reaper records them as failed."""
        if not keys:
            return
        cur = await conn.execute(
            self.q.expire_leases,
            {"ids": [k[0] for k in keys], "tokens": [UUID(int=k[1]) for k in keys]},
        )
        expired = [int(row[0]) for row in await cur.fetchall()]
        self.state.counters.given_up += len(expired)
        if expired:
            log.log(
                level,
                "jobs %s: %s; their leases were expired, and the reaper records the attempts "
                "as failed", ", ".join(map(str, expired)), why,
            )  # fmt: skip

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            # Any service that met an outage, not only this loop: the heartbeat's own
            # connection may have been replaced unseen (a dead idle one is, by the pool), and
            # a claim whose answer was lost in the outage waits under the lease until a look.
            recovered = self.state.outage.recovered_at
            if recovered > self._recovery_seen:
                self._recovery_seen = recovered
                self._look_soon = max(self._look_soon, 2)
            try:
                # Bounded, connecting included: a blackholed connection must not stall the
                # loop, or handlers would outlive their leases unnoticed.
                await asyncio.wait_for(self.beat(), self.interval)
                self.state.outage.ok()
            except Exception as exc:
                round_failed(log, "heartbeat", exc, self.state.outage)
                self._look_soon = 2
            else:
                # After the beat, not in it: the lease never waits for this count.
                await self._look_at_fleet_safely()
            # While the fleet changes (workers starting or stopping), count it again every
            # FLEET_SETTLE seconds until two counts agree, not only at the next beat: workers
            # that start together each count a fleet still registering, and would open
            # connections on a share too big for up to an interval.
            beat_at = time.monotonic() + self.interval
            while self.fleet_changing and not stopping.is_set():
                await pause(stopping, min(FLEET_SETTLE, max(beat_at - time.monotonic(), 0.0)))
                left = beat_at - time.monotonic()
                if left <= 0:
                    break
                await self._look_at_fleet_safely(left)  # never past the next beat's time
            await pause(stopping, max(beat_at - time.monotonic(), 0.0))

    async def _look_at_fleet_safely(self, within: float | None = None) -> None:
        try:
            async with self.pool.connection() as conn:
                await asyncio.wait_for(self.look_at_fleet(conn), within or self.interval)
        except Exception as exc:
            log.debug("could not count the fleet (%s); the next beat will", exc)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
