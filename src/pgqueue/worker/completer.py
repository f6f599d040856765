"""Writes results in batches: many completions per statement, fenced per job by lease token.

A completion waits at most ``flush_interval`` (a few milliseconds) for company; a full batch goes
at once. What can go wrong with a batch, and what it costs:

- **The connection is lost or the server is down.** The batch is kept and retried with a
  growing pause: the worker's lease covers its jobs meanwhile (if that lapses too, a reaper takes
  the jobs and the late write is fenced out). A write that failed may still have committed (the
  connection died after COMMIT reached the server), so the retry also asks which of its acks are
  already in (``applied_completions``) rather than reporting our own results as stale.
- **A row is locked by someone else** (an operator's ``SELECT ... FOR UPDATE``). An ack waits
  for a row lock at most ``ACK_LOCK_TIMEOUT`` (``complete_jobs`` sets ``lock_timeout`` for its
  own transaction); then the batch is written again with
  ``complete_jobs_skip_locked``, which skips rows locked right now, and the skipped acks wait
  aside and are tried again a little later, alone. One locked row costs that row.
- **The database refuses the statement** (a value it cannot store, a trigger of yours that
  raises). Outcomes are built to be storable (see ``executor``), so this is a surprise: the
  batch is split in halves until the refused outcome is alone, and that outcome is replaced by
  a plain failed attempt saying why (``on_refused``); the rest of the batch is written. If even
  that cannot be written, the attempt is given up (``on_given_up``): logged as an error, and its
  lease expired so that the reaper records it. Nothing is retried forever in silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
from psycopg import errors as pgerrors
from psycopg_pool import PoolTimeout

from ..sql import Queries
from . import arrays
from .connections import Connections
from .executor import Outcome, ack_params
from .fetcher import LIMIT_CLAIM_IDLE_MS
from .outage import Outage
from .state import round_failed

log = logging.getLogger("pgqueue.worker.completer")

#: First pause before an ack whose row was locked is tried again; it doubles up to the maximum.
BUSY_RETRY = 0.2
BUSY_RETRY_MAX = 5.0
#: Pause after a failed write (connection lost, server down), doubling up to the maximum.
FAILED_RETRY = 0.5
FAILED_RETRY_MAX = 5.0

#: SQLSTATE classes of errors that say nothing about the batch's contents: the server or the
#: connection is in trouble, or a transient conflict. The batch is retried as it is.
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")
#: lock_not_available, object_in_use, and read_only_sql_transaction: a standby not promoted yet
#: (a failover), which refuses every write alike; the outage counts it as unreachable too.
_TRANSIENT_STATES = ("55P03", "55006", "25006")


def transient(exc: BaseException, conn: psycopg.AsyncConnection[Any] | None) -> bool:
    """Whether a failed write should simply be retried (True) or says something about the
    outcomes in it (False)."""
    if isinstance(exc, OSError | TimeoutError | PoolTimeout):
        return True
    if conn is not None and (conn.closed or conn.broken):
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate or ""
        return (
            state[:2] in _TRANSIENT_CLASSES
            or state in _TRANSIENT_STATES
            or (isinstance(exc, psycopg.OperationalError) and not state)
        )
    return False


class Completer:
    def __init__(
        self,
        pool: Connections,
        q: Queries,
        on_written: Callable[[list[Outcome], set[int]], None],
        *,
        on_refused: Callable[[Outcome, str], Outcome | None] = lambda o, reason: None,
        on_given_up: Callable[[Outcome, str], None] = lambda o, reason: None,
        flush_interval: float = 0.002,
        batch_size: int = 500,
        outage: Outage | None = None,
    ) -> None:
        self.pool = pool
        self.outage = outage or Outage()
        self.q = q
        self.on_written = on_written
        #: Given an outcome the database refused and why: the plain failure to write instead.
        self.on_refused = on_refused
        #: An outcome that could not be written in any form.
        self.on_given_up = on_given_up
        self.flush_interval = flush_interval
        self.batch_size = batch_size
        self.pending: list[Outcome] = []
        #: Acks whose rows were locked by someone else: (outcome, when to try again, pause).
        self.busy: list[tuple[Outcome, float, float]] = []
        self._has_work = asyncio.Event()
        self._stopped = False
        #: The last write of the head of ``pending`` failed: it may have committed unseen.
        self._uncertain = False
        self._failures = 0
        self.writes = 0
        #: The last write said someone waits for results (complete_jobs' second column).
        self.awaited = False
        #: True when no handler runs and none is buffered: no outcome is coming soon.
        self.idle: Callable[[], bool] = lambda: False
        #: Set while the writer waits for company: ends the wait once none can come.
        self._company: asyncio.Event | None = None
        #: Given a batch, the queues whose waiting workers its acks give work (slots freed):
        #: their wake (wake_waiting_workers) rides in the ack's own transaction, so it costs
        #: no round trip of its own and is sent only if the acks commit.
        self.wakes: Callable[[list[Outcome]], list[str]] = lambda batch: []
        #: Told the backend pid of each connection a wake went out on (the worker ignores its
        #: own notifications).
        self.own_pid: Callable[[int], None] = lambda pid: None
        #: The queues the last write woke with its acks (the runtime wakes the others).
        self.woke: frozenset[str] = frozenset()
        #: Given a batch, hand_off_queue_slots' parameters when its acks free slots of a limited
        #: queue that may go straight to that queue's next jobs (None: no hand-off).
        self.hand_off: Callable[[list[Outcome]], dict[str, Any] | None] = lambda batch: None
        #: Told the jobs a write's hand-off claimed (its rows, their lease token), before its
        #: acks are reported.
        self.on_handed_off: Callable[[list[Any], UUID], None] = lambda rows, token: None
        #: The freed slots the last write handed off, per queue; and jobs handed off in all.
        self.handed: Counter[str] = Counter()
        self.handed_off = 0

    def submit(self, outcome: Outcome) -> None:
        self.pending.append(outcome)
        self._has_work.set()
        if self._company is not None and (len(self.pending) >= self.batch_size or self.idle()):
            self._company.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Flush until stopped; the final flush is ``drain``'s job. Never cancelled mid-write
        (a write that committed unseen would be resent and look stale): ``stop`` wakes it."""
        loop = asyncio.get_running_loop()
        while True:
            if self.busy and not self.pending:
                wait = max(min(at for _, at, _ in self.busy) - loop.time(), 0.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._has_work.wait(), wait)
            else:
                await self._has_work.wait()
            if self._stopped or stopping.is_set():
                return
            if self.pending and len(self.pending) < self.batch_size and not self.idle():
                await self._wait_for_company()
            await self.flush_once()

    async def _wait_for_company(self) -> None:
        """Wait a moment (``flush_interval``) for more outcomes, and no longer than it takes
        the batch to fill or the last running handler to end: a worker whose slots all wait
        for these acks (a limit equal to its concurrency frees its slots only when they are
        written) would otherwise wait for nothing. With a queue limit equal to the
        concurrency, the full interval was a fifth of each claim-run-ack cycle."""
        company = self._company = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_interval):
                    await company.wait()
        finally:
            self._company = None

    async def flush_once(self) -> None:
        """Write one batch: due busy acks first (alone, never waiting on a lock), then the
        head of ``pending``."""
        await self._retry_busy(force=self._stopped)
        if not self.pending:
            if not self._stopped:
                self._has_work.clear()
            return
        batch = sorted(self.pending[: self.batch_size], key=_job_id)
        del self.pending[: len(batch)]
        uncertain = self._uncertain or any(o.uncertain for o in batch)
        try:
            await self._write_isolating(batch, uncertain)
        except Exception as exc:
            self._failures += 1
            pause = min(FAILED_RETRY * 2 ** (self._failures - 1), FAILED_RETRY_MAX)
            what = f"writing {len(batch)} results (next try in {pause:.1f} s)"
            round_failed(log, what, exc, self.outage)
            self._uncertain = True
            await asyncio.sleep(pause)
            return
        self.outage.ok()
        self._failures = 0
        self._uncertain = False
        if not self.pending and not self._stopped:
            self._has_work.clear()

    async def _write_isolating(self, batch: list[Outcome], uncertain: bool) -> None:
        """Write ``batch`` (already out of ``pending``); a statement the database refuses for
        what is in it is split until the refused outcome is alone (see the module docstring). On
        a transient error what is not settled yet goes back to ``pending``, and the error
        propagates: the parts already written are never written or reported again."""
        groups = [batch]
        while groups:
            group = groups.pop()
            try:
                accepted, busy = await self._write(group, uncertain)
            except Exception as exc:
                if _is_transient(exc):
                    self.pending[:0] = [*group, *(o for g in groups for o in g)]
                    raise
                if len(group) > 1:
                    half = len(group) // 2
                    groups += [group[half:], group[:half]]
                    continue
                self._refused(group[0], exc)
                continue
            self._report(group, accepted, busy)

    def _refused(self, outcome: Outcome, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {str(exc).strip()}"
        replacement = None if outcome.replaces else self.on_refused(outcome, reason)
        if replacement is None:
            log.error("job %d: giving the attempt up, its outcome cannot be written (%s)",
                      outcome.job_id, reason)  # fmt: skip
            self.on_given_up(outcome, reason)
            return
        log.error("job %d: the database refused the attempt's outcome (%s); recording it as a "
                  "failed attempt instead", outcome.job_id, reason)  # fmt: skip
        replacement.replaces = True
        self.pending.append(replacement)
        self._has_work.set()

    async def _retry_busy(self, *, force: bool) -> None:
        """Try the acks whose rows were locked, once their pause is over (all of them when
        ``force``), skipping rows still locked."""
        if not self.busy:
            return
        now = asyncio.get_running_loop().time()
        due = sorted((o for o, at, _ in self.busy if force or at <= now), key=_job_id)
        if not due:
            return
        pauses = {id(o): p for o, _, p in self.busy}
        taken = {id(o) for o in due}
        self.busy = [entry for entry in self.busy if id(entry[0]) not in taken]
        try:
            accepted, busy = await self._write(due, True, skip_locked=True)
        except Exception as exc:
            if not _is_transient(exc):  # about their contents: the isolating path sorts it out
                self.pending += due
                self._has_work.set()
                return
            self.busy += [(o, now + pauses[id(o)], pauses[id(o)]) for o in due]
            round_failed(
                log, f"writing {len(due)} results whose rows were locked", exc, self.outage
            )
            return
        self._report(due, accepted, busy, pauses)

    def _report(
        self,
        batch: list[Outcome],
        accepted: set[int],
        busy: set[int],
        pauses: dict[int, float] | None = None,
    ) -> None:
        now = asyncio.get_running_loop().time()
        for o in batch:
            if o.job_id in busy:
                pause = min(2 * (pauses or {}).get(id(o), BUSY_RETRY / 2), BUSY_RETRY_MAX)
                self.busy.append((o, now + pause, pause))
        written = [o for o in batch if o.job_id not in busy]
        if written:
            self.on_written(written, accepted)

    async def _write(
        self, batch: list[Outcome], uncertain: bool, *, skip_locked: bool = False
    ) -> tuple[set[int], set[int]]:
        """(acks the database took, acks whose rows were locked and must wait)."""
        params = ack_params(batch, packed=True)
        async with self.pool.connection() as conn:
            try:
                return await self._write_on(conn, batch, params, uncertain, skip_locked)
            except Exception as exc:
                if transient(exc, conn):
                    raise TransientWriteError(str(exc)) from exc
                raise

    async def _write_on(
        self,
        conn: psycopg.AsyncConnection[Any],
        batch: list[Outcome],
        params: dict[str, Any],
        uncertain: bool,
        skip_locked: bool,
    ) -> tuple[set[int], set[int]]:
        arrays.register(conn)  # idempotent, and a few microseconds a write
        self.woke = frozenset()
        self.handed = Counter()
        wake = [] if skip_locked else self.wakes(batch)
        # Not when the write may repeat one that committed unseen: its freed slots were then
        # counted by that write (see hand_off_queue_slots).
        hand = None if skip_locked or uncertain else self.hand_off(batch)
        if skip_locked:
            cur = await conn.execute(self.q.complete_jobs_skip_locked, params)
        else:
            # The wake rides in the acks' statement (complete_jobs_waking): the NOTIFY commits
            # with the acks, never without them, and the statement goes with its Sync.
            ack = self.q.complete_jobs
            if wake:
                self.own_pid(conn.info.backend_pid)
                ack, params = self.q.complete_jobs_waking, {**params, "queues": wake}
            try:
                if hand is not None:
                    # One implicit transaction until the pipeline's sync: the hand-off's claims
                    # commit with the acks, never without them. (Each statement goes out as it
                    # is queued: the server holds the acked rows until the sync arrives, with
                    # no idle timeout meanwhile; docs/guarantees.md, "Cut off mid-transaction".)
                    async with conn.pipeline():
                        cur = await conn.execute(ack, params)
                        # The limited claim's settings: the scans' are what the hand-off needs.
                        idle = {"idle": LIMIT_CLAIM_IDLE_MS}
                        await conn.execute(self.q.limit_claim_settings, idle)
                        handing = await conn.execute(self.q.hand_off_queue_slots, hand)
                    rows = await handing.fetchall()
                    if rows:
                        self.handed = Counter(str(row[1]) for row in rows)
                        self.handed_off += len(rows)
                        self.on_handed_off(rows, hand["token"])
                else:
                    cur = await conn.execute(ack, params)
                self.woke = frozenset(wake)
            except pgerrors.LockNotAvailable:
                # A row locked by someone else: write around it (module docstring).
                skip_locked = True
                cur = await conn.execute(self.q.complete_jobs_skip_locked, params)
        rows = await cur.fetchall()
        accepted = {int(row[0]) for row in rows}
        # Someone waits for results (App.wait): the runtime announces the finished jobs.
        self.awaited = bool(rows and rows[0][1])
        self.writes += 1
        missing = [o for o in batch if o.job_id not in accepted]
        busy: set[int] = set()
        if missing and (uncertain or skip_locked):
            cur = await conn.execute(
                self.q.applied_completions,
                {
                    "ids": [o.job_id for o in missing],
                    "tokens": [o.lease_token for o in missing],
                },
            )
            for job_id, running in await cur.fetchall():
                (busy if running else accepted).add(int(job_id))
        return accepted, busy

    def stop(self) -> None:
        self._stopped = True
        self._has_work.set()
        if self._company is not None:
            self._company.set()

    async def drain(self, timeout: float) -> list[Outcome]:
        """Flush everything pending (shutdown); what the database never took."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.pending or self.busy) and loop.time() < deadline:
            await self.flush_once()
            if self.busy and not self.pending:
                await asyncio.sleep(min(BUSY_RETRY, max(deadline - loop.time(), 0)))
        return [*self.pending, *(o for o, _, _ in self.busy)]


class TransientWriteError(Exception):
    """A write failed for reasons that say nothing about its outcomes (see ``transient``)."""


def _job_id(outcome: Outcome) -> int:
    return outcome.job_id


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TransientWriteError | OSError | TimeoutError | PoolTimeout)
