"""The single background loop: one read of every panel per interval, pushed to all pages.

It also remembers what a snapshot alone cannot say: the depth it observed in seconds no worker
sampled, the previous insert counter (for the INSERT arrow's rate), and the cumulative counters
behind /metrics. When the database goes away it publishes a "reconnecting" snapshot that keeps
the last figures, and retries until it is back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from .. import __version__, stats
from . import figures, queries
from .broadcast import Broadcaster
from .database import Database, writable_tables

log = logging.getLogger("pgqueue.dashboard")


@dataclass
class Totals:
    """Cumulative since this dashboard started: what Prometheus counters need."""

    finished: dict[tuple[str, str], int] = field(default_factory=dict)
    pickup: dict[int, int] = field(default_factory=dict)
    run: dict[int, int] = field(default_factory=dict)
    watermark: datetime | None = None

    def add(self, rows: list[tuple[Any, ...]]) -> None:
        for queue, succeeded, retried, dead, lost, pickups, runs in rows:
            for outcome, n in zip(stats.OUTCOMES, (succeeded, retried, dead, lost), strict=True):
                key = (str(queue), outcome)
                self.finished[key] = self.finished.get(key, 0) + int(n)
            for hist in pickups:
                stats.merge(self.pickup, hist)
            for hist in runs:
                stats.merge(self.run, hist)


class Refresher:
    def __init__(
        self,
        database: Database,
        schema: str,
        *,
        interval: float = 1.0,
        late_after: float = 15.0,
        long_transaction: float = 300.0,
        dead_tuple_ratio: float = 0.2,
        dead_tuple_minimum: int = 10_000,
    ) -> None:
        self.database = database
        self.schema = schema
        self.interval = interval
        self.late_after = late_after
        #: The health strip's thresholds: a transaction holding back vacuum this long (s), and
        #: dead rows in pgqueue_jobs past this share of the live ones (and at least the minimum).
        self.long_transaction = long_transaction
        self.dead_tuple_ratio = dead_tuple_ratio
        self.dead_tuple_minimum = dead_tuple_minimum
        self._dead: queries.DeadCounts | None = None
        self.broadcaster = Broadcaster()
        self.refreshes = 0
        #: Refreshes that failed (database down, tables missing): /metrics counts them.
        self.failures = 0
        #: Wall time of the last successful refresh's queries, round trips included.
        self.last_duration: float | None = None
        self.snapshot: dict[str, Any] | None = None
        self.totals = Totals()
        self._observed: deque[tuple[int, dict[str, int]]] = deque(maxlen=figures.WINDOW + 5)
        self._inserts: tuple[float, int] | None = None
        self._insert_rate: float | None = None
        self._down_reason: str | None = None
        #: pgqueue tables the dashboard's role could write to (["*"]: a superuser); None until
        #: the first read has looked.
        self.writable: list[str] | None = None
        #: False while the database is unreachable (the last snapshot is then stale).
        self.healthy = False

    async def run(self) -> None:
        """Refresh forever at the interval; errors become a reconnecting state, never a crash."""
        while True:
            started = time.monotonic()
            try:
                await self.refresh_once()
            except psycopg.errors.UndefinedTable as exc:
                await self._publish_down(exc, "pgqueue's tables are missing: run `pgqueue migrate`")
            except (psycopg.Error, OSError) as exc:
                await self._publish_down(exc)
            except Exception as exc:  # a bug must not stop the loop for every open page
                log.exception("dashboard refresh failed")
                await self._publish_down(exc)
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(self.interval - elapsed, 0.05))

    async def refresh_once(self) -> dict[str, Any]:
        started = time.perf_counter()
        async with self.database.session() as conn:
            if self.writable is None:
                self.writable = await writable_tables(conn, self.schema)
                self._warn_if_writable()
            reading = await queries.read(
                conn, self.schema, late_after=self.late_after,
                long_transaction=self.long_transaction, dead=self._dead,
            )  # fmt: skip
            self._dead = reading.dead
            # Cheap: after the first read it covers only the seconds settled since the last.
            until, rows = await queries.finished_since(conn, self.schema, self.totals.watermark)
            self.totals.add(rows)
            self.totals.watermark = until
        self.last_duration = time.perf_counter() - started
        self.refreshes += 1
        self.healthy = True
        if self._down_reason is not None:
            log.warning("dashboard reads the database again")
            self._down_reason = None
        snapshot = self._build(reading)
        self.snapshot = snapshot
        await self.broadcaster.publish(json.dumps(snapshot, separators=(",", ":")).encode())
        return snapshot

    def _warn_if_writable(self) -> None:
        if not self.writable:
            return
        what = (
            "is a superuser"
            if self.writable == ["*"]
            else "can write to " + ", ".join(self.writable)
        )
        log.warning(
            "the dashboard's database role %s: the dashboard never writes, but connect it as a "
            "role with SELECT only (docs/dashboard.md, 'A role with SELECT only')",
            what,
        )

    def _build(self, r: queries.Reading) -> dict[str, Any]:
        waiting_now = {q: c["queued"] + c["retrying"] for q, c in r.depth.items()}
        # The latest read of a second stands for it: the chart's right edge is the depth now.
        if self._observed and self._observed[-1][0] == r.second:
            self._observed.pop()
        self._observed.append((r.second, waiting_now))
        # Seconds some registered worker was running (and so sampling the depth every second).
        sampling = [
            (r.now - w["uptime"], r.now if not w["late"] else r.now - w["heartbeat_age"])
            for w in r.workers
        ]
        depth = figures.depth_series(
            r.depth_samples, dict(self._observed), r.second, sampling=sampling
        )
        if r.inserts_total is not None:
            if self._inserts is not None and r.now > self._inserts[0]:
                delta = max(r.inserts_total - self._inserts[1], 0)
                self._insert_rate = delta / (r.now - self._inserts[0])
            self._inserts = (r.now, r.inserts_total)
        totals = {s: sum(c[s] for c in r.depth.values()) for s in ("queued", "retrying", "running")}
        tput = r.throughput
        alive = sum(1 for w in r.workers if not w["late"])
        return {
            "status": "ok",
            "error": None,
            "version": __version__,
            "now": r.now,
            "refresh": self.refreshes,
            "interval": self.interval,
            "late_after": self.late_after,
            # The role can write: the page says so (connect as a SELECT-only role instead).
            "writable": self.writable or [],
            # A hot standby: {"lag": seconds behind its primary or None, "streaming"}; else None.
            "replica": r.replica,
            "refresh_ms": round(self.last_duration * 1000, 1) if self.last_duration else None,
            "tiles": {
                "throughput": tput["rate"],
                **r.latency,
                "waiting": totals["queued"] + totals["retrying"],
                "queued": totals["queued"],
                "retrying": totals["retrying"],
                "running": totals["running"],
                "retries_60s": tput["retries_60s"],
                "failed_60s": tput["failed_60s"],
            },
            "throughput": {k: tput[k] for k in ("t", "succeeded", "failed", "settled_until")},
            "depth": depth,
            "queues": figures.queue_table(
                r.depth,
                dead=r.dead_by_queue,
                finished=r.queue_finished,
                pickup=r.queue_pickup,
                heads=r.heads,
                head_tasks=r.head_tasks,
                settings=r.settings,
                workers=r.workers,
            ),
            "health": figures.health(
                oldest_transaction=r.oldest_transaction,
                hidden_sessions=r.hidden_sessions,
                tuples=r.tuples,
                workers=r.workers,
                dead_tuple_ratio=self.dead_tuple_ratio,
                dead_tuple_minimum=self.dead_tuple_minimum,
                late_after=self.late_after,
            ),
            "long_transaction": self.long_transaction,
            # Paused queues, with or without jobs: a badge wherever the page names one.
            "paused_queues": r.paused,
            "workers": r.workers,
            "workers_alive": alive,
            "running": r.running,
            "problems": r.problems,
            "problem_counts": r.problem_counts,
            "feed": r.feed,
            "schedules": r.schedules,
            "rates": {
                "insert": self._insert_rate,
                "claim": tput["rate"],
                "heartbeat_workers": alive,
            },
        }

    async def _publish_down(self, exc: BaseException, reason: str | None = None) -> None:
        """Keep the last figures on every page, marked stale, with the reason; log once."""
        self.healthy = False
        self.failures += 1
        if reason is None:
            text = str(exc).strip()
            reason = text.splitlines()[0] if text else type(exc).__name__
        if reason != self._down_reason:
            log.warning("dashboard cannot read the database: %s", reason)
            self._down_reason = reason
        base = dict(self.snapshot) if self.snapshot else {"version": __version__}
        base.update({"status": "reconnecting", "error": reason})
        await self.broadcaster.publish(json.dumps(base, separators=(",", ":")).encode())
