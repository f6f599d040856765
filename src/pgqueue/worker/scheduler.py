"""The periodic scheduler: turns due cron ticks into ordinary jobs.

Every worker runs one; there is no leader to elect or lose. Exactly one job per (schedule, tick)
rests on three things, each enough to stop a particular race:

- a due schedule is taken with ``FOR UPDATE SKIP LOCKED``, and its job insert and the advance of
  ``next_run_at`` commit together, so no two schedulers fire the same row at once and a fired
  tick is never due again;
- the unique index on ``(schedule_name, schedule_tick)`` refuses a second job for a tick even if
  two transactions did race (the insert is ``ON CONFLICT DO NOTHING``);
- ticks are computed from the stored scheduled time and "due" is ``next_run_at <= now()`` on the
  database clock, so workers whose clocks disagree still agree on every tick.

The local clock is never consulted: even the sleep length is measured by the database.

Every scheduler fires every live schedule, whichever app owns it: firing only inserts a job, and
no owner's ticks are lost while only another app's workers run. Ownership (``App(name=...)``)
decides who writes and retires a schedule; see ``sync``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from ..schedules import MissedPolicy, due_ticks, next_tick
from .connections import Connections
from .outage import Outage
from .state import pause, round_failed, spread

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("pgqueue.worker.scheduler")

BATCH = 100  # schedules fired per transaction; a full batch loops again at once
_EPSILON = 0.002  # wake just after the tick so that now() has passed it
_BACKOFF_FIRST = 0.5
_BACKOFF_CAP = 30.0


class Scheduler:
    """Syncs the app's declared schedules and fires due ticks; see the module docstring."""

    def __init__(self, app: App, *, interval: float = 1.0, outage: Outage | None = None) -> None:
        if not interval > 0:
            raise ValueError("interval must be a positive number of seconds")
        self.app = app
        self.outage = outage or Outage()
        self.q = app.q
        self.interval = float(interval)
        self.synced = False
        self.fired = 0  # jobs enqueued by this scheduler, for tests and stats
        self._unreadable: set[str] = set()

    async def sync(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Write this app's declared schedules and apply its declared retirements; nothing else.

        Schedules belong to the app that declared them (``App(name=...)``), so a sync never
        disables what its code does not declare: another service, or another version of this
        app in a rolling deploy, may still declare it. Those rows are only named in a warning.
        A name owned by another app is left as it is, with an error naming both apps.
        New rows, a changed cron, or a schedule declared again after it was retired get a
        ``next_run_at`` computed from the database clock; otherwise the stored one stands.
        ``paused`` is the operator's and is never changed here.
        """
        app, q = self.app, self.q
        # This cluster's schedules only: a schedule enqueues on the cluster of its queue.
        declared = sorted(app._cluster_schedules().values(), key=lambda s: s.name)
        names = [s.name for s in declared]
        retiring = sorted(app.retired_schedules)
        async with conn.transaction():
            await conn.execute(q.lock_schedule_sync, {"schema": app.schema})
            cur = await conn.execute(q.database_now)
            row = await cur.fetchone()
            assert row is not None
            db_now: datetime = row[0]
            cur = await conn.execute(
                q.schedule_owners, {"app": app.name, "names": names + retiring}
            )
            foreign = {str(name): str(owner) for name, owner in await cur.fetchall()}
            ours = [s for s in declared if s.name not in foreign]
            if ours:
                await conn.execute(
                    q.upsert_schedules,
                    {
                        "app": app.name,
                        "names": [s.name for s in ours],
                        "crons": [s.cron for s in ours],
                        "tasks": [s.task for s in ours],
                        "queues": [s.queue for s in ours],
                        "args": [s.args_json for s in ours],
                        "priorities": [s.priority for s in ours],
                        "max_attempts": [s.max_attempts for s in ours],
                        "next_run_ats": [next_tick(s.cron, db_now) for s in ours],
                        "misseds": [s.missed for s in ours],
                        "max_catchups": [s.max_catchup for s in ours],
                    },
                )
            retired: list[str] = []
            if retiring:
                cur = await conn.execute(q.retire_schedules, {"app": app.name, "names": retiring})
                retired = sorted(str(r[0]) for r in await cur.fetchall())
            cur = await conn.execute(q.undeclared_schedules, {"app": app.name, "declared": names})
            undeclared = [str(r[0]) for r in await cur.fetchall()]
        for name, owner in foreign.items():
            action = "declares" if name in app.periodic_schedules else "retires"
            log.error(
                "schedule %r belongs to app %r, not to app %r which %s it: left as it is. Give "
                "one of them another schedule name or, if %r is %r renamed, run "
                "`pgqueue schedules transfer %s %s`",
                name, owner, app.name, action, app.name, owner, owner, app.name,
            )  # fmt: skip
        if retired:
            log.info("schedules retired by app %r: %s", app.name, ", ".join(retired))
        if undeclared:
            log.warning(
                "schedules of app %r that this code does not declare keep firing: %s (retire "
                "them with app.retire_schedule(...) or `pgqueue schedules prune`)",
                app.name, ", ".join(undeclared),
            )  # fmt: skip
        self.synced = True

    async def tick(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Fire every due schedule once (one transaction per batch); returns jobs enqueued."""
        total = 0
        while True:
            inserted, advanced = await self._fire_batch(conn)
            total += inserted
            if advanced < BATCH:  # a full batch may have left more due rows behind
                return total

    async def _fire_batch(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
        async with conn.transaction():
            cur = await conn.execute(self.q.lock_due_schedules, {"limit": BATCH})
            rows = await cur.fetchall()
            if not rows:
                return 0, 0
            job_names: list[str] = []
            job_ticks: list[datetime] = []
            job_groups: list[str | None] = []
            names: list[str] = []
            next_run_ats: list[datetime] = []
            last_ticks: list[datetime] = []
            for name, cron, next_run_at, missed, max_catchup, db_now, task, args in rows:
                policy: MissedPolicy = "all" if missed == "all" else "latest"
                try:
                    ticks, following = due_ticks(cron, next_run_at, db_now, policy, max_catchup)
                except Exception as exc:  # a cron this library cannot read: leave the row be
                    if name not in self._unreadable:
                        log.error("schedule %r: cannot compute its ticks (%s); skipped", name, exc)
                    self._unreadable.add(name)
                    continue
                self._unreadable.discard(name)
                skipped_from = ticks[0] if ticks else None
                if skipped_from is not None and skipped_from > next_run_at:
                    log.warning(
                        "schedule %r: ticks from %s to before %s were missed (policy %s)",
                        name, next_run_at.isoformat(), skipped_from.isoformat(), policy,
                    )  # fmt: skip
                job_names.extend([name] * len(ticks))
                job_ticks.extend(ticks)
                job_groups.extend([self._group(task, args)] * len(ticks))
                names.append(name)
                next_run_ats.append(following)
                last_ticks.append(ticks[-1])
            inserted = 0
            if job_names:
                cur = await conn.execute(
                    self.q.insert_schedule_jobs,
                    {"names": job_names, "ticks": job_ticks, "limit_keys": job_groups},
                )
                inserted = len(await cur.fetchall())
                await conn.execute(
                    self.q.advance_schedules,
                    {"names": names, "next_run_ats": next_run_ats, "last_ticks": last_ticks},
                )
        self.fired += inserted
        return inserted, len(names)

    def _group(self, task: str, args: str) -> str | None:
        """The limit group of a schedule's jobs when this app declares the task's limit (as a
        producer computes it); None leaves it to the database ('' if it limits the task)."""
        spec = self.app.tasks.get(task)
        if spec is None or spec.limits is None:
            return None
        return spec.limits.waiting_group(task, json.loads(args))

    async def seconds_until_due(self, conn: psycopg.AsyncConnection[Any]) -> float | None:
        """Seconds until the earliest live schedule is due, by the database clock."""
        cur = await conn.execute(self.q.seconds_until_next_schedule)
        row = await cur.fetchone()
        return None if row is None or row[0] is None else float(row[0])

    async def run(
        self,
        pool: Connections,
        stop: asyncio.Event,
        fleet: Callable[[], int] = lambda: 1,
    ) -> None:
        """Tick, then sleep until the earliest ``next_run_at`` or until ``stop``. Syncs first
        unless ``sync`` already ran. Between ticks a worker looks again for changed schedules
        (a new one, a resumed one) every ``interval`` times the live workers (``spread``): the
        fleet looks about once per ``interval``, whatever its size. Database errors are logged
        and retried with a capped exponential backoff: a scheduler never takes its worker
        down."""
        backoff = _BACKOFF_FIRST
        while not stop.is_set():
            try:
                async with pool.connection() as conn:
                    if not self.synced:
                        await self.sync(conn)
                    fired = await self.tick(conn)
                    wait = await self.seconds_until_due(conn)
            except Exception as exc:
                round_failed(
                    log, f"scheduler round (next try in {backoff:.1f} s)", exc, self.outage
                )
                await pause(stop, backoff)
                backoff = min(backoff * 2, _BACKOFF_CAP)
                continue
            backoff = _BACKOFF_FIRST
            self.outage.ok()
            look = spread(self.interval, fleet())
            if wait is None:
                delay = look
            elif wait > 0:
                delay = min(wait + _EPSILON, look)
            elif fired:
                delay = 0.0  # more became due while we fired
            elif self._unreadable:
                delay = self.interval  # an unfireable row stays due: don't spin on it
            else:
                # Due but not ours: another scheduler holds it and is about to commit.
                delay = min(0.05, self.interval)
            if delay > 0:
                await pause(stop, delay)
