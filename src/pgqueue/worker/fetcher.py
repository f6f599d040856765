"""The claim loop: claims in batches, a little ahead of free slots, never beyond its budget.

A worker holds at most ``concurrency + prefetch`` leases of unfinished jobs (running or
prefetched); finished ones wait only for the completer's next batch, and claiming pauses if those
pile up. Jobs claimed beyond the free slots wait in a local buffer and start
the moment a slot frees, without a round trip; the buffer is refilled in batches, not per slot.
Its size follows the recent completion rate (what finished in the last window of
``PREFETCH_WINDOW`` seconds, at most ``prefetch``), so short jobs are prefetched and slow ones are
not: a job never waits in this buffer while it could run on an idle worker for long.

It claims when woken (a NOTIFY, a freed slot, a reaped job) and on every poll tick, which is the
correctness path: a lost notification costs at most one poll interval. A notification that
arrives while every slot is busy is kept until a slot frees; it is never dropped. A worker whose
claim came back short (it is about to wait) asks the database when the next job it could claim
becomes due (``next_ready_at``) and sleeps no longer than that, so a job enqueued to run later,
or a retry whose backoff ends, starts on time without waiting for the poll.

Jobs not due yet cost the plain claim (``claim_jobs``) a pass over them when their priority is
higher than the due ones'; the fetcher claims with ``claim_jobs_by_priority`` instead while
``next_ready_at`` says some job is not due yet (asked before the first claim, at every short
claim, and at least every ``DELAYED_CHECK`` seconds while busy). Both statements return the same
jobs; only their cost differs.

A long transaction elsewhere (a snapshot held open) stops vacuum, and a claim that reads the ready
index from its start then walks every job claimed since that snapshot began. Once a claim from the
start takes ``SLOW_CLAIM`` seconds, the fetcher claims from where its last claim ended
(``claim_jobs_after``: the same jobs, in the same order, but for a job of that priority that
became ready behind that point). Those jobs are claimed by a sweep (``claim_jobs_before``) at
least every ``BOUND_RESET`` seconds (longer when its walk costs more: ``BOUND_RESET_RATIO``),
which is how long such a job can wait for its turn; the same round asks ``next_ready_at``, whose
walk over the priorities is as slow. The sweep runs beside the claims, on a connection of its
own, with part of the claim budget set aside for it: the jobs enqueued meanwhile never wait for
its walk (with both walks on the claim path, at 2,000 jobs/s and a snapshot held for ten
minutes, they were the 1.2 s of the pickup p99). A sweep whose walk is fast again means vacuum
caught up: claims start from the beginning again. ``horizon.HorizonWatch`` names the
transaction in the log.

The same mode serves claims that read past a backlog they may not take (a paused or limited
queue's, limited tasks' jobs): a claim from the start that took ``DRY_CLAIM`` and came back
short while the first waiting job is due leaves the next claims after everything waiting then
(``claim_dry_position``, "the dry bound"). There the look at ``next_ready_at`` after a short
claim goes on as a task beside the claims (``_look_beside``), a notification that finds nothing
after the bound owes a sweep as soon as its period allows (a slot freed by this worker's own job
does not), and a sweep that comes back full sends claims back to the start.

A job whose task this worker does not know (an older worker during a rolling deploy) is handed
back at once without counting the attempt, and from then on the worker claims only its own tasks:
such jobs wait, untouched, for a worker that knows them.

Jobs under a limit or a rate (concepts/limits.md) are left out of those claims and taken by the
limited claim (``claim_limited``), which next_ready_at says is needed: from the head of the
queue while its first jobs are of groups with room (``claim_head``), else and regularly by the
walk over the groups (``claim_walk``), which gives every group its turn. A round then runs both
claims, the limited one first every other round, so neither kind of job waits on the other.
A claim that came back short is not repeated until something may have changed (a notification,
a slot freed by one of this worker's limited jobs, the poll) or ``DRY_FOR`` has passed: jobs of
one kind enqueued while the other keeps the worker busy wake nobody (no worker waits).
A group out of rate tells how long until it has rate again, and the fetcher sleeps no longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from json import JSONDecoder
from typing import Any
from uuid import UUID, uuid4

import psycopg

from ..limits import TaskLimits, group_name
from ..sql import Queries
from . import arrays
from .connections import Connections
from .horizon import HorizonWatch
from .state import ClaimedJob, WorkerState, pause, round_failed

log = logging.getLogger("pgqueue.worker.fetcher")

PREFETCH_WINDOW = 0.05
#: Seconds between looks at whether jobs not due yet exist, while the worker is busy.
DELAYED_CHECK = 1.0
#: Limit groups the limited claim walks per job it wants: groups that are full are walked past,
#: so the walk looks further than one group per job. As far per job as the last claim had to go
#: to its furthest group that gave a job, times LIMIT_SCAN_MARGIN, at most LIMIT_SCAN_FACTOR
#: (and that when the last claim got nothing); in all at least LIMIT_SCAN_MIN, at most
#: LIMIT_SCAN_MAX. Every group walked costs the claim an index descent, and every group locked a
#: scan of its jobs and a row lock: a fixed factor of 2 walked 400 groups and locked 311 for 200
#: jobs over 1,000 keys, a fifth of them full.
LIMIT_SCAN_FACTOR = 2.0
LIMIT_SCAN_MARGIN = 1.25
LIMIT_SCAN_MIN = 16
LIMIT_SCAN_MAX = 1000
#: The limited claim tries the head of the queue first (claim_head, reading HEAD_SCAN_FACTOR
#: waiting jobs in claim order per job it wants), but every HEAD_WALK_EVERY-th claim walks the
#: groups (round-robin: every group gets its turn, jobs deep in the backlog too), a claim walks
#: for the rest when the head held jobs it leaves to the walk (rated tasks, limited queues), and
#: so do the HEAD_COOL claims after a blocked head (see claim_head).
HEAD_SCAN_FACTOR = 2
HEAD_WALK_EVERY = 4
HEAD_COOL = 8
#: How long the claim's hand-back of jobs that lost their limit group waits for a row another
#: transaction holds (regroup_leases_waiting); past it, the job runs where it was claimed.
REGROUP_LOCK_WAIT = "2s"
#: The limited claim's session ends if it stalls this long inside its transaction (milliseconds).
LIMIT_CLAIM_IDLE_MS = "5000"
#: Seconds a stopping fetcher waits for its looks beside the claims to end once cancelled.
SIDE_CANCEL_WAIT = 2.0
#: Past every job id: the bound a short slow claim leaves (claim_dry_position).
LAST_ID = 2**63 - 1
#: When another worker held a limit group or queue this claim wanted: look again after this
#: long (doubling while it stays held, up to the poll interval).
LIMIT_BUSY_RETRY = 0.01
#: How long a claim that came back short is skipped while the other kind keeps the worker busy
#: (see claim_round): jobs of the other kind enqueued meanwhile wake nobody (no worker waits),
#: so this bounds their wait; each look costs a claim (the plain one reads past limited jobs).
DRY_FOR = 0.05
#: A claim from the start of the ready index this slow (seconds) makes the next claims start
#: where the last one ended (claim_jobs_after). A plain claim takes well under a millisecond.
SLOW_CLAIM = 0.02
#: A claim from the start this slow that came back short, with the first waiting job due yet
#: untaken, read past a backlog it may not take: the next claims start after it (the dry bound,
#: claim_dry_position). Lower than SLOW_CLAIM: that signal, not time, says a backlog was skipped,
#: and a worker busy with limited jobs repeats such a claim every DRY_FOR (a queue limited to
#: the worker's concurrency with 100,000 jobs waiting: 5 ms each, 9 % of its drain's time).
DRY_CLAIM = 0.002
#: While claims start where the last ended, a sweep claims the jobs that became ready behind that
#: point (released, reaped, a past run_at, a resumed queue) at least this often (seconds), so
#: such a job waits at most about this long; and no more often than BOUND_RESET_RATIO times what
#: its last walk took, so that its walks, slow while vacuum is held back, take a small share of
#: the server's time.
BOUND_RESET = 1.0
BOUND_RESET_RATIO = 20.0
#: The most jobs a sweep claims at once (set aside from the claim budget while it runs: see
#: _start_sweep); a full batch is followed at once by the next, from where it ended.
SWEEP_LIMIT = 50
#: Added to the time since the last claim when asking next_ready_at for jobs that fell due
#: after it: the two statements' own delays on the way to the server.
LOOKBACK_MARGIN = 0.05

#: The claim's arguments arrive as jsonb's text output: one JSON document, nothing around it, so
#: ``raw_decode`` needs none of ``json.loads``'s checks for whitespace and trailing data (1.6 us
#: a job, raw_decode 0.5).
_decode = JSONDecoder().raw_decode


def read_head(rows: list[Any], limit: int) -> tuple[list[int], list[str], int, bool]:
    """lock_head_groups' rows (id, task, key, locked, room) in claim order: the ids and keys
    to claim (each group's first job, if its group is locked for this claim; at most
    ``limit``), what the walk could take from the same groups (per group, its jobs read up to
    its free slots), and whether some job read is the walk's (room NULL: a rated task's, a
    limited queue's)."""
    ids: list[int] = []
    keys: list[str] = []
    could: dict[tuple[str, str], int] = {}
    walks = False
    for job_id, task, key, locked, room in rows:
        if room is None:
            walks = True
            continue
        room = max(room, 0)  # below 0: a limit lowered under what runs
        group = (task, key)
        if group in could:  # the group's first job only (see lock_head_groups)
            could[group] = min(could[group] + 1, room)
            continue
        could[group] = min(1, room)
        if locked and len(ids) < limit:
            ids.append(job_id)
            keys.append(key)
    return ids, keys, sum(could.values()), walks


class Fetcher:
    def __init__(
        self,
        pool: Connections,
        q: Queries,
        state: WorkerState,
        *,
        worker_id: UUID,
        queues: list[str] | None,
        tasks: Mapping[str, object],
        poll_interval: float,
        declared: Mapping[str, TaskLimits] | None = None,
        start: Callable[[ClaimedJob], None],
        wake: Callable[[list[str]], None] = lambda queues: None,
        schema: str = "pgqueue",
        sweeps: Connections | None = None,
    ) -> None:
        self.schema = schema
        self.pool = pool
        #: The sweep's connections: another lane than the claims', so that claims go on meanwhile.
        self.sweeps = sweeps or pool
        self.q = q
        self.state = state
        self.worker_id = worker_id
        self.queues = queues
        self.tasks = tasks
        #: The limits this worker's tasks declare: a claimed job of one of them that has no
        #: limit group is given back with it (regroup_leases).
        self.declared: Mapping[str, TaskLimits] = declared or {}
        self.poll_interval = poll_interval
        self.start = start
        self.wake = wake
        self.plain = q.claim_jobs if queues is None else q.claim_jobs_in_queues
        self.by_priority = (
            q.claim_jobs_by_priority if queues is None else q.claim_jobs_by_priority_in_queues
        )
        self.after = q.claim_jobs_after if queues is None else q.claim_jobs_after_in_queues
        self.before = q.claim_jobs_before if queues is None else q.claim_jobs_before_in_queues
        self.next_ready = q.next_ready_at if queues is None else q.next_ready_at_in_queues
        self.dry_position = (
            q.claim_dry_position if queues is None else q.claim_dry_position_in_queues
        )
        self.claims = 0
        #: Claims that started where the last one ended (claim_jobs_after), and sweeps behind it.
        self.claims_after = 0
        self.sweeps_run = 0
        self._window_started = 0.0
        self._window_finished = 0
        self._recent = 0  # handlers finished in the last complete window
        #: A notification arrived since the last claim (kept until a claim can be made); or a
        #: slot of this worker's freed, which may let it claim again too.
        self._notified = False
        #: A notification (not a freed slot) arrived since the last claim.
        self._told = False
        #: Loop time at which the earliest job we know of becomes due (None: none known).
        self._due_at: float | None = None
        #: Some job was not due yet at the last look (``_checked``, loop time): claim by priority.
        self.delayed = False
        self._checked = -DELAYED_CHECK
        #: When the last claim was sent (the event loop's clock): see next_due_in.
        self._claim_sent = 0.0
        #: Set once a claimed job's task was unknown: claims are then limited to these tasks.
        self.only_tasks: list[str] | None = None
        self._unknown_warned: set[str] = set()
        #: Told after every claim whether the fetcher is about to wait for work (the notifier's
        #: ``set_waiting``; nothing to tell when not listening).
        self.on_waiting: Callable[[bool], None] = lambda waiting: None
        #: Jobs under limits may wait for this worker (next_ready_at): run the limited claim.
        self.limited = False
        #: The limited queue whose acks hand their slots to its next jobs
        #: (hand_off_queue_slots): the only limited work the last limited claim found.
        self.limited_queues: set[str] = set()
        #: The limited claim's round-robin position: the last group it walked to.
        self._cursor: tuple[str, str] = ("", "")
        #: Groups the next limited claim walks per job it wants (see LIMIT_SCAN_FACTOR).
        self._scan_per_job = LIMIT_SCAN_FACTOR
        #: A claim of that kind came back short: skip it until this loop time, or until something
        #: may have changed (a notification, a freed slot, the poll).
        self._plain_dry = 0.0
        self._limited_dry = 0.0
        #: Counts of those changes, so that one arriving while a claim is on its way is not
        #: overwritten by that claim's own skip (see claim_round).
        self._plain_changes = 0
        self._limited_changes = 0
        self._limited_first = False
        #: Limited claims made, and the first one that may try the head again (claim_limited);
        #: whether the last walk locked a limit group (else the head has none to give).
        self._limited_claims = 0
        self._head_after = 0
        self._groups_seen = False
        self._busy_retry = LIMIT_BUSY_RETRY
        #: The worker's own tasks (the limited claim only takes those: no hand-backs).
        self._task_names = sorted(tasks)
        #: Where the last claim ended (priority, run_at as text, id): claim_jobs_after's start.
        self.bound: tuple[int, str, int] | None = None
        #: The bound was left by a short claim (claim_dry_position), not by a full one.
        self._bound_dry = False
        #: A notification found nothing after that bound: sweep once the period allows.
        self._sweep_owed = False
        #: The look at next_ready_at in flight beside the claims (behind a short claim's bound).
        self._look: asyncio.Task[None] | None = None
        #: What the last walk from the start of the index took (seconds): a claim from the start,
        #: or a sweep that walked to the bound.
        self._from_start_took = 0.0
        #: The sweep in flight, the claim budget set aside for it, when the last one started,
        #: and where the next starts (run_at as text, id; None: from the start of the priority).
        self._sweep: asyncio.Task[None] | None = None
        self._reserved = 0
        self._swept_at = -math.inf
        self._sweep_from: tuple[str, int] | None = None
        self.horizon = HorizonWatch(pool, q)
        self._horizon_look: asyncio.Task[None] | None = None

    def buffer_target(self, now: float) -> int:
        """How many jobs to keep prefetched: what finished in the last window, capped."""
        state = self.state
        if now - self._window_started >= PREFETCH_WINDOW:
            elapsed = now - self._window_started
            done = state.finished - self._window_finished
            # A window that ran long (the worker idled) scales down to one window's worth.
            self._recent = int(done * min(1.0, PREFETCH_WINDOW / elapsed)) if elapsed else 0
            self._window_started, self._window_finished = now, state.finished
        return min(state.prefetch, self._recent)

    def wanted(self, now: float) -> int:
        """Jobs to claim now (0: not worth a round trip yet)."""
        state = self.state
        if len(state.held) - state.running - len(state.buffer) > state.concurrency + state.prefetch:
            return 0  # back-pressure: results are piling up faster than they can be written
        target = self.buffer_target(now)
        free = state.concurrency - state.running - len(state.buffer)
        # The sweep's share comes out of the prefetch, never out of idle slots: set aside when
        # the buffer's target was large, it would otherwise stop every claim once the target
        # shrinks (the backlog drained) until the sweep ends.
        budget = max(free + target - self._reserved, free)
        if budget <= 0:
            return 0
        if state.free_slots > 0 and not state.buffer:
            return budget  # a slot is idle for want of a job
        # Otherwise wait until the buffer runs low (half the target left), then claim all the
        # budget allows: every claim costs the database ~0.5 ms whatever its size. Jobs that
        # never await leave most slots unused (one slot runs them back to back), so the budget
        # alone would call for a claim every few dozen jobs.
        low = len(state.buffer) <= target // 2
        return budget if low and budget >= max(target // 2, 1) else 0

    async def claim_round(self, want: int) -> list[ClaimedJob]:
        """One round of claims for ``want`` jobs: the plain claim, and the limited one while
        limits apply (see the module docstring)."""
        if not self.limited:
            return await self.claim(want)
        self._limited_first = not self._limited_first
        jobs: list[ClaimedJob] = []
        loop = asyncio.get_running_loop()
        for limited in (True, False) if self._limited_first else (False, True):
            left = want - len(jobs)
            if left <= 0:
                break
            now = loop.time()
            # A change (a freed slot, a notification) that arrives while the claim is on its way
            # may be what it missed (it counted the slot as taken): the claim is not skipped
            # then. Overwritten by the claim's skip, the round that change woke skipped it and
            # the worker slept until the poll with a job claimable.
            if limited and now >= self._limited_dry:
                seen = self._limited_changes
                got = await self.claim_limited(left)
                short = len(got) < left and seen == self._limited_changes
                self._limited_dry = now + DRY_FOR if short else 0.0
            elif not limited and now >= self._plain_dry:
                seen = self._plain_changes
                got = await self.claim(left)
                short = len(got) < left and seen == self._plain_changes
                self._plain_dry = now + DRY_FOR if short else 0.0
            else:
                continue
            jobs += got
        return jobs

    def _refresh(self) -> None:
        """Something may have changed for both claims: try each again."""
        self._plain_dry = self._limited_dry = 0.0
        self._plain_changes += 1
        self._limited_changes += 1

    def hand_off_params(self, ids: list[int], tokens: list[UUID]) -> dict[str, Any]:
        """hand_off_queue_slots' parameters for these acks (see completer.hand_off). Packed:
        the hand-off travels with the acks, on the completer's connection, which knows the
        type. Not to jobs of tasks this worker declares limited: the hand-off takes jobs
        without a group, and such a job has lost its own, which the limited claim gives back
        (regroup_leases)."""
        tasks = self.only_tasks or self._task_names
        return {
            "ids": arrays.int8_array(ids),
            "tokens": arrays.uuid_array(tokens),
            "worker_id": self.worker_id,
            "token": uuid4(),
            "tasks": [t for t in tasks if t not in self.declared] if self.declared else tasks,
        }

    def handed_off(self, rows: list[Any], token: UUID) -> None:
        """Start the jobs an ack's hand-off claimed (rows as claim_limited_jobs')."""
        self.claims += 1
        for job in self._jobs(rows, token, limited=True):
            self.start(job)

    def slot_freed(self) -> None:
        """A limited job of this worker ended: its group may take another job."""
        self._limited_dry = 0.0
        self._limited_changes += 1
        self._notified = True
        self.state.wakeup.set()

    async def claim_limited(self, limit: int) -> list[ClaimedJob]:
        """Jobs under limits: from the head of the queue when it has them (claim_head), and
        by the walk over the groups (claim_walk) every HEAD_WALK_EVERY-th claim, for what the
        head left to it, and while the head came back blocked lately."""
        self._limited_claims += 1
        if (
            not self._groups_seen
            or self._limited_claims % HEAD_WALK_EVERY == 0
            or self._limited_claims < self._head_after
        ):
            return await self.claim_walk(limit)
        jobs, blocked, walks = await self.claim_head(limit)
        if blocked:
            # The groups at the head are full or few: the walk, now and for a while, which
            # reads past none of them.
            self._head_after = self._limited_claims + HEAD_COOL
        if (blocked or walks) and len(jobs) < limit:
            jobs += await self.claim_walk(limit - len(jobs))
        return jobs

    @contextlib.asynccontextmanager
    async def _limited_transaction(
        self, conn: psycopg.AsyncConnection[Any]
    ) -> AsyncIterator[psycopg.AsyncPipeline]:
        """A limited claim's transaction on ``conn`` (claim_head's, claim_walk's). Two round
        trips, in pipeline mode: BEGIN, the isolation level, the settings and the first
        statement go together (its rows are needed for the claim, which therefore starts after
        it ended: its snapshot is newer than the locks), then the claim and COMMIT. One round
        trip per statement made six. The first round trip ends with a Sync (the caller's
        ``pipeline.sync()``), not psycopg's flush request: only a Sync starts the server's
        idle timeout, so a worker cut off while it chooses what to claim holds the groups'
        locks LIMIT_CLAIM_IDLE_MS at most, not until the network says it is gone."""
        self._claim_sent = asyncio.get_running_loop().time()
        async with conn.pipeline() as pipeline, conn.transaction():
            await conn.execute(self.q.begin_limited_claim)
            await conn.execute(self.q.limit_claim_settings, {"idle": LIMIT_CLAIM_IDLE_MS})
            yield pipeline

    async def claim_head(self, limit: int) -> tuple[list[ClaimedJob], bool, bool]:
        """Jobs of free limit groups at the head of the queue (lock_head_groups, then
        claim_head_jobs, one transaction): one range read of the ready index instead of a
        descent per group, for a backlog whose first jobs can run. Also whether the head is
        blocked (it gave nothing, or under half of what the walk could take from its groups, as
        their free slots and jobs allow, or of the claim's want) and whether it holds jobs for
        the walk (of a rated task, of a limited queue)."""
        token = uuid4()
        q = self.q
        rows: list[Any] = []
        claim: psycopg.AsyncCursor[Any] | None = None
        async with self.pool.connection() as conn:
            async with self._limited_transaction(conn) as pipeline:
                cur = await conn.execute(
                    q.lock_head_groups,
                    {
                        "schema": self.schema,
                        "queues": self.queues,
                        "tasks": self.only_tasks or self._task_names,
                        "scan": min(HEAD_SCAN_FACTOR * limit, LIMIT_SCAN_MAX),
                    },
                )
                await pipeline.sync()
                ids, keys, could, walks = read_head(await cur.fetchall(), limit)
                if ids:
                    arrays.register(conn)
                    claim = await conn.execute(
                        q.claim_head_jobs,
                        {
                            "worker_id": self.worker_id,
                            "token": token,
                            "ids": arrays.int8_array(ids),
                            "keys": arrays.utf8_texts(conn, keys),
                        },
                    )
            if claim is not None:  # its rows arrived with the COMMIT's
                rows = await claim.fetchall()
        self.claims += 1
        got = len(rows)
        blocked = got == 0 or 2 * got < min(limit, could)
        return self._jobs(rows, token, limited=True), blocked, walks

    async def claim_walk(self, limit: int) -> list[ClaimedJob]:
        """Jobs under limits (lock_limit_groups, then claim_limited_jobs, one transaction)."""
        token = uuid4()
        q = self.q
        scan = min(max(math.ceil(self._scan_per_job * limit), LIMIT_SCAN_MIN), LIMIT_SCAN_MAX)
        tasks = self.only_tasks or self._task_names
        params: dict[str, Any] = {
            "schema": self.schema,
            "queues": self.queues,
            "tasks": tasks,
            "after_task": self._cursor[0],
            "after_key": self._cursor[1],
            "scan": scan,
        }
        rows: list[Any] = []
        claim: psycopg.AsyncCursor[Any] | None = None
        async with self.pool.connection() as conn:
            async with self._limited_transaction(conn) as pipeline:
                cur = await conn.execute(q.lock_limit_groups, params)
                await pipeline.sync()
                # In walk order (the statement's joins may return its rows in another): the
                # claim gives turns in the order of g_tasks, and the cursor is a walk position.
                locks = sorted(await cur.fetchall(), key=lambda row: row[3] or 0)
                order: dict[tuple[str, str], int] = {}
                g_tasks: list[str] = []
                g_keys: list[str] = []
                lq: list[str] = []
                blocked: list[str] = []
                busy = False
                wait: float | None = None
                last: tuple[str, str] | None = None
                # Hand-offs only while one limited queue is all the limited work this worker
                # may take: they refill that queue, and a walk over other groups or queues
                # gives each its turn (fair claiming), which hand-offs would bypass.
                queue_rows = [name for kind, name, *_ in locks if kind == "q"]
                alone = len(queue_rows) == 1 and not any(row[0] == "g" for row in locks)
                self.limited_queues = set(queue_rows) if alone else set()
                limited_tasks: frozenset[str] = frozenset()
                for kind, name, key, n, locked, rate_wait, listed in locks:
                    if kind in ("q", "p"):
                        limited_tasks = frozenset(listed)
                        if locked:
                            lq.append(name)
                        else:
                            blocked.append(name)
                            busy = busy or kind == "q"
                        continue
                    last = (name, key)
                    order[last] = n
                    if locked:
                        g_tasks.append(name)
                        g_keys.append(key)
                    elif rate_wait is not None:
                        wait = rate_wait if wait is None else min(wait, rate_wait)
                self._groups_seen = bool(g_tasks)
                if g_tasks or lq:
                    arrays.register(conn)
                    names = [group_name(t, k) for t, k in zip(g_tasks, g_keys, strict=True)]
                    claim = await conn.execute(
                        q.claim_limited_jobs,
                        {
                            "worker_id": self.worker_id,
                            "token": token,
                            "limit": limit,
                            "queues": self.queues,
                            "tasks": tasks,
                            "g_tasks": arrays.utf8_texts(conn, g_tasks),
                            "g_keys": arrays.utf8_texts(conn, g_keys),
                            "g_names": arrays.utf8_texts(conn, names),
                            "lq": lq,
                            "blocked": blocked,
                        },
                    )
            if claim is not None:  # its rows arrived with the COMMIT's
                rows = await claim.fetchall()
            jobs = self._jobs(rows, token, limited=True)
            # A limited queue's jobs without a group, of a limited task (declared, or limited
            # in the database: the walk's queue rows list those).
            strays = [job for job, row in zip(jobs, rows, strict=True) if row[7] is None
                      and (job.task in self.declared or job.task in limited_tasks)]  # fmt: skip
            if strays:
                jobs = await self._regroup(conn, jobs, strays)
        self.claims += 1
        # Round-robin: the next walk starts after the furthest group that gave a job (or,
        # when none did, after the last one walked).
        taken = [order[(task, key)] for _, _, task, _, _, _, _, key, _ in rows if key is not None
                 and (task, key) in order]  # fmt: skip
        if taken:
            furthest = max(taken)
            self._cursor = next(group for group, n in order.items() if n == furthest)
            reached = sum(1 for n in order.values() if n <= furthest)  # walked up to it
            per_job = reached / len(taken) * LIMIT_SCAN_MARGIN
            self._scan_per_job = min(per_job, LIMIT_SCAN_FACTOR)
        else:
            self._scan_per_job = LIMIT_SCAN_FACTOR
            if last is not None:
                self._cursor = last
        if wait is not None:
            self.ready_in(max(wait, 0.001))
        if busy and len(rows) < limit:
            self.ready_in(self._busy_retry)
            self._busy_retry = min(self._busy_retry * 2, self.poll_interval)
        else:
            self._busy_retry = LIMIT_BUSY_RETRY
        return jobs

    def _bound_period(self) -> float:
        """Seconds between sweeps behind the bound (see BOUND_RESET)."""
        return max(BOUND_RESET, self._from_start_took * BOUND_RESET_RATIO)

    def _claim_after_bound(self) -> bool:
        """Whether claims start where the last one ended (see the module docstring)."""
        slow = DRY_CLAIM if self._bound_dry else SLOW_CLAIM
        return self.bound is not None and self._from_start_took >= slow

    def _look_beside(self, loop: asyncio.AbstractEventLoop) -> None:
        """Behind a short claim's bound: the look at next_ready_at that the claim loop makes
        after a short claim, as a task beside the claims (cheap there, but vacuum may be held
        back too, and then it is as slow as a claim from the start), which wakes the loop to
        recompute its wait."""
        if self._look is not None and not self._look.done():
            return

        async def look() -> None:
            await self._learn_next_due(loop)
            self.state.wakeup.set()

        self._look = asyncio.create_task(look())

    def _start_sweep(self, now: float, want: int) -> bool:
        """Start a sweep behind the bound if one is due, with part of ``want`` set aside for it
        (True: the budget changed). Only while claims start where the last ended."""
        if self._sweep is not None and not self._sweep.done():
            return False
        period = self._bound_period()
        if now - self._swept_at < period:
            return False
        # At most half of what the claims want, so they go on while it walks; all of one job
        # only when a period overdue (a worker that frees one slot at a time still sweeps) or
        # owed to a notification that found nothing after a short claim's bound.
        overdue = now - self._swept_at >= 2 * period or self._sweep_owed
        reserve = min(want // 2, SWEEP_LIMIT) or int(overdue)
        if not reserve:
            return False
        self._sweep_owed = False
        self._swept_at = now
        self._reserved = reserve
        self._sweep = asyncio.create_task(self._sweep_round(self._reserved))
        return True

    async def _sweep_round(self, limit: int) -> None:
        """One sweep, then (while claims still start where the last ended) the look at
        next_ready_at that the claim loop would otherwise wait for. Off the claim path: a
        failure is logged and the next round tries again."""
        loop = asyncio.get_running_loop()
        whole = self._sweep_from is None
        try:
            sent = loop.time()
            rows = await self._claim_behind(limit)
            took = loop.time() - sent
        except Exception as exc:
            log.debug("the sweep behind the claims' bound failed (%s)", exc)
            return
        finally:
            self._reserved = 0
            self.state.wakeup.set()  # the budget set aside is free again
        if len(rows) == limit and limit and self._bound_dry:
            # Behind a short claim's bound (claim_dry_position) a whole backlog became
            # claimable (a queue resumed, a limit removed): claims start from the start again,
            # where it is, rather than taking it a sweep's share at a time.
            self.bound = None
            self._bound_dry = False
            self._sweep_from = None
            self._notified = True  # claim at once (the finally woke the loop)
            return
        if len(rows) == limit and limit:
            self._swept_at = -math.inf  # more may wait: the next batch at once, from here
        else:
            self._sweep_from = None
            if whole:  # it walked from the start of the priority to the bound
                self._from_start_took = took
                if took >= SLOW_CLAIM:
                    await self.horizon.claims_slow(took, loop.time())
        if self._claim_after_bound():
            await self._learn_next_due(loop, self.sweeps)
            self.state.wakeup.set()

    async def _claim_behind(self, limit: int) -> list[ClaimedJob]:
        """Claim up to ``limit`` jobs of the bound's priority that are behind the bound
        (claim_jobs_before), from where the last full sweep ended; they start at once."""
        if self.bound is None or limit <= 0:
            return []
        token = uuid4()
        priority, run_at, job_id = self.bound
        from_run_at, from_id = self._sweep_from or ("-infinity", 0)
        params: dict[str, Any] = {
            "worker_id": self.worker_id, "limit": limit, "token": token,
            "tasks": self.only_tasks, "after_priority": priority, "after_run_at": run_at,
            "after_id": job_id, "from_run_at": from_run_at, "from_id": from_id,
        }  # fmt: skip
        if self.queues is not None:
            params["queues"] = self.queues
        async with self.sweeps.connection() as conn:
            cur = await conn.execute(self.before, params)
            rows = await cur.fetchall()
            if rows:
                self._sweep_from = (rows[-1][10], rows[-1][0])
            rows = [row[:9] for row in rows]
            jobs = await self._hand_back(conn, self._jobs(rows, token), rows)
            self.sweeps_run += 1
        for job in jobs:
            self.start(job)
        return jobs

    @staticmethod
    def _jobs(rows: list[Any], token: UUID, *, limited: bool = False) -> list[ClaimedJob]:
        """Rows of a claim: id, queue, task, args, attempt, max_attempts, pickup, ..., meta
        (a plain claim's rows have the stray flag before the meta, the limited claim's the
        limit key)."""
        return [
            ClaimedJob(
                row[0],
                row[1],
                row[2],
                _decode(row[3])[0],
                row[4],
                row[5],
                token,
                row[6],
                limited=limited,
                meta=None if row[-1] is None else _decode(row[-1])[0],
            )
            for row in rows
        ]

    async def claim(self, limit: int) -> list[ClaimedJob]:
        token = uuid4()  # this claim's lease token (see claim_jobs)
        params: dict[str, Any] = {
            "worker_id": self.worker_id,
            "limit": limit,
            "token": token,
            "tasks": self.only_tasks,
        }
        if self.queues is not None:
            params["queues"] = self.queues
        loop = asyncio.get_running_loop()
        after = self._claim_after_bound()
        if after:
            assert self.bound is not None
            params["after_priority"], params["after_run_at"], params["after_id"] = self.bound
            statement = self.after
            self.claims_after += 1
        else:
            statement = self.by_priority if self.delayed else self.plain
        async with self.pool.connection() as conn:
            self._claim_sent = sent = loop.time()
            cur = await conn.execute(statement, params)
            rows = await cur.fetchall()
            if after:
                if rows:
                    last = rows[-1]
                    self.bound = (last[9], last[10], last[0])
                rows = [row[:9] for row in rows]
            else:
                self._from_start_took = loop.time() - sent
                # This claim walked what a sweep would: the next is due a period from now.
                self._swept_at, self._sweep_from = sent, None
                if self._bound_dry:  # a claim from the start: that bound is behind it
                    self.bound, self._bound_dry = None, False
                if len(rows) < limit and self._from_start_took >= DRY_CLAIM:
                    # It read to the end of the index, past jobs it may not take if the first
                    # waiting one is due: the next claims start after everything waiting now.
                    look: dict[str, Any] = {
                        "lookback": loop.time() - sent + LOOKBACK_MARGIN,
                        "queues": self.queues,
                    }
                    where = await conn.execute(self.dry_position, look)
                    position = await where.fetchone()
                    if position is not None:
                        self.bound = (position[0], position[1], LAST_ID)
                        self._bound_dry = True
                if not self._bound_dry and rows and self._from_start_took >= SLOW_CLAIM:
                    # The next claims start here: where this one ended, in claim order.
                    where = await conn.execute(self.q.claim_position, {"id": rows[-1][0]})
                    position = await where.fetchone()
                    if position is not None:
                        self.bound = (position[0], position[1], rows[-1][0])
                        self._bound_dry = False
            jobs = await self._hand_back(conn, self._jobs(rows, token), rows)
        self.claims += 1
        if not after:
            if self._from_start_took < SLOW_CLAIM:
                self.horizon.claims_fast()
            elif self._horizon_look is None or self._horizon_look.done():
                # Off the claim path: the jobs just claimed start without waiting for it.
                self._horizon_look = asyncio.create_task(
                    self.horizon.claims_slow(self._from_start_took, loop.time())
                )
        return jobs

    async def _hand_back(
        self, conn: psycopg.AsyncConnection[Any], jobs: list[ClaimedJob], rows: list[Any]
    ) -> list[ClaimedJob]:
        """A plain claim's jobs (``rows``: its rows), less those given back: of tasks this
        worker does not know, and of limited tasks (the plain claim takes only jobs without a
        group): those this worker declares limited, and those the database limits (the rows'
        ``stray`` column: an operator's limit, which the worker's code may not have)."""
        names = {job.task for job in jobs}
        if not self.tasks.keys() >= names:
            jobs = await self._hand_back_unknown(conn, jobs)
        flagged = {row[0] for row in rows if row[7]}
        if flagged or (self.declared and not self.declared.keys().isdisjoint(names)):
            strays = [j for j in jobs if j.task in self.declared or j.id in flagged]
            if strays:
                jobs = await self._regroup(conn, jobs, strays)
        return jobs

    async def _regroup(
        self, conn: psycopg.AsyncConnection[Any], jobs: list[ClaimedJob], strays: list[ClaimedJob]
    ) -> list[ClaimedJob]:
        """Give ``strays`` (jobs of limited tasks claimed without a limit group) back with
        their group, for the limited claim; returns the jobs of ``jobs`` to run here. A task
        the worker does not declare limited has no key function here: its jobs go in the group
        '' (the task's group when its limit is task-wide, as the operator's are)."""
        keys = [
            "" if (declared := self.declared.get(job.task)) is None
            else declared.waiting_group(job.task, job.args)
            for job in strays
        ]  # fmt: skip
        params: dict[str, list[Any]] = {
            "ids": [job.id for job in strays],
            "tokens": [job.lease_token for job in strays],
            "keys": keys,
        }
        cur = await conn.execute(self.q.regroup_leases, params)
        back = {int(row[0]) for row in await cur.fetchall()}
        if len(back) < len(strays):
            # Rows locked by another transaction right now (an operator's cancel, a bulk
            # action): wait for them rather than run their jobs outside the limit. Rows no
            # longer leased here (reaped meanwhile) are not updated by either statement.
            left = [i for i, job in enumerate(strays) if job.id not in back]
            try:
                cur = await conn.execute(
                    self.q.regroup_leases_waiting,
                    {
                        **{name: [values[i] for i in left] for name, values in params.items()},
                        "lock_timeout": REGROUP_LOCK_WAIT,
                    },
                )
                back |= {int(row[0]) for row in await cur.fetchall()}
            except psycopg.errors.LockNotAvailable:
                log.warning(
                    "claimed jobs of limited tasks without their limit group stayed locked by "
                    "another transaction for %s; they run here, outside the limit",
                    REGROUP_LOCK_WAIT,
                )
        if not back:
            return jobs
        log.warning(
            "%d claimed jobs of limited tasks (%s) had no limit group; given back with it, "
            "they run under the limit",
            len(back),
            ", ".join(sorted({job.task for job in strays if job.id in back})),
        )
        self.limited = True  # they wait for the limited claim now: this worker's and others'
        self.slot_freed()
        self.wake(sorted({job.queue for job in strays if job.id in back}))
        return [job for job in jobs if job.id not in back]

    async def _hand_back_unknown(
        self, conn: psycopg.AsyncConnection[Any], jobs: list[ClaimedJob]
    ) -> list[ClaimedJob]:
        """Give back jobs of tasks this worker does not know, attempt uncounted, and claim only
        known tasks from now on (see the module docstring)."""
        unknown = sorted((job for job in jobs if job.task not in self.tasks), key=lambda j: j.id)
        cur = await conn.execute(
            self.q.release_leases,
            {"ids": [job.id for job in unknown], "tokens": [job.lease_token for job in unknown]},
        )
        released = {int(row[0]) for row in await cur.fetchall()}
        self.only_tasks = sorted(self.tasks)
        for name in sorted({job.task for job in unknown} - self._unknown_warned):
            self._unknown_warned.add(name)
            log.warning(
                "jobs of task %r are waiting, but no handler is registered for it in this worker "
                "(registered: %s); they are left for a worker that knows it, and this worker "
                "now claims only its own tasks",
                name,
                ", ".join(self.only_tasks) or "none",
            )
        self.wake([job.queue for job in unknown])
        # A job that could not be given back (its row locked right now) runs here and fails
        # as an unknown task, attempt counted, like any other failure.
        return [job for job in jobs if job.task in self.tasks or job.id not in released]

    async def next_due_in(self, pool: Connections | None = None) -> float | None:
        """Seconds until the earliest job this worker could claim becomes due, by the database
        clock (None: nothing is waiting to become due; 0: one fell due since the last claim).
        Asked on the claims' connection, or on ``pool`` (the sweep's)."""
        # Since the last claim was sent, plus a margin for the two statements' own delays: only
        # an interval of the worker's clock, the times compared are the database's.
        lookback = asyncio.get_running_loop().time() - self._claim_sent + LOOKBACK_MARGIN
        params: dict[str, Any] = {"lookback": lookback}
        if self.queues is not None:
            params["queues"] = self.queues
        async with (pool or self.pool).connection() as conn:
            cur = await conn.execute(self.next_ready, params)
            row = await cur.fetchone()
        if row is None:
            return None
        limited = bool(row[1])
        if limited and not self.limited:
            # Limited jobs this worker did not claim for: claim now. The look is made after a
            # short claim, when the loop is about to wait, and the NOTIFY of their enqueue woke
            # that very claim: without this they waited for the poll.
            self._limited_dry = 0.0
            self._limited_changes += 1
            self._notified = True
        self.limited = limited
        return None if row[0] is None else max(float(row[0]), 0.0)

    def ready_in(self, seconds: float) -> None:
        """A job this worker may claim becomes due in ``seconds`` (a retry it just wrote): wake
        then, if not sooner."""
        due = asyncio.get_running_loop().time() + seconds
        if self._due_at is None or due < self._due_at:
            self._due_at = due
            self.state.wakeup.set()  # recompute the wait

    async def run(self, stopping: asyncio.Event) -> None:
        try:
            await self._run(stopping)
        finally:
            sides = {s for s in (self._horizon_look, self._look) if s is not None and not s.done()}
            for side in sides:
                side.cancel()  # a diagnosis or a look: not worth delaying a shutdown
            if self._sweep is not None and not self._sweep.done():
                # Never cancelled: the jobs it claims go through start (handed back when
                # stopping), not left running under this worker's lease.
                await asyncio.wait({self._sweep})
            if sides:
                # Their cancellation ends before the worker closes its pool: psycopg cancels a
                # query in the server and waits for it to end. Left to finish on their own,
                # they outlived the worker, and whoever closed the event loop cancelled them
                # again, which interrupted that wait ("query cancellation interrupted").
                await asyncio.wait(sides, timeout=SIDE_CANCEL_WAIT)

    async def _run(self, stopping: asyncio.Event) -> None:
        state = self.state
        maybe_more = True
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + self.poll_interval
        failures = 0
        while not stopping.is_set():
            now = loop.time()
            if self._due_at is not None and now >= self._due_at:
                self._due_at = None
                maybe_more = True
                self._refresh()
            want = self.wanted(now)
            if want and (maybe_more or self._notified):
                bounded = self._claim_after_bound()
                if bounded and self._start_sweep(now, want):
                    continue  # the budget left for this claim is smaller
                if maybe_more and now - self._checked >= DELAYED_CHECK:
                    # Busy (or starting): an idle worker looks after each short claim instead,
                    # off the path of the job that woke it. While claims start where the last
                    # ended because vacuum is held back, the sweep's round looks, off the claim
                    # path (the look's walk is as slow as the claims'); behind a short claim's
                    # bound the look goes on beside the claims (vacuum may be held back too).
                    if not bounded:
                        await self._learn_next_due(loop)
                        self._refresh()
                    elif self._bound_dry:
                        self._look_beside(loop)
                state.wakeup.clear()
                self._notified = False
                notified, self._told = self._told, False
                try:
                    jobs = await self.claim_round(want)
                    failures = 0
                    state.outage.ok()
                except Exception as exc:
                    failures += 1
                    round_failed(log, "claim", exc, state.outage)
                    await pause(stopping, min(0.1 * 2**failures, self.poll_interval * 5))
                    continue
                if stopping.is_set():
                    # Claimed during shutdown: give them straight back through the runtime.
                    for job in jobs:
                        self.start(job)
                    return
                for job in jobs:
                    self.start(job)
                maybe_more = len(jobs) == want
                # A short claim: the queue is drained and the fetcher will wait, so producers
                # should notify (see notifier). A full one: it claims again on its own.
                self.on_waiting(not maybe_more)
                dry = self._bound_dry and self._claim_after_bound()
                if not maybe_more and notified and dry:
                    # Woken for work that the claim after a short claim's bound did not find:
                    # it may lie behind the bound (a transaction that began before it, a queue
                    # resumed). The sweep looks there as soon as its period allows, even for a
                    # worker that then waits (see _start_sweep).
                    self._sweep_owed = True
                    due = self._swept_at + self._bound_period()
                    self._due_at = due if self._due_at is None else min(due, self._due_at)
                if not maybe_more and not (
                    # Short because the limits' slots ran out, not the jobs: the end of each
                    # limited job just claimed wakes this loop to claim again (slot_freed), and
                    # a busy worker's look at delayed jobs is the once-a-second one above. A
                    # look after every such claim cost a round trip per slot cycle.
                    any(job.limited for job in jobs) and now - self._checked < DELAYED_CHECK
                ):
                    if not self._claim_after_bound():
                        # The jobs just claimed start first (their slots run at this yield).
                        await asyncio.sleep(0)
                        await self._learn_next_due(loop)
                    elif dry:
                        self._look_beside(loop)
                continue
            wake_at = next_poll if self._due_at is None else min(next_poll, self._due_at)
            woke = await self._wait(stopping, max(wake_at - loop.time(), 0.0))
            if not woke or loop.time() >= next_poll:
                next_poll = loop.time() + self.poll_interval
                maybe_more = True
                self._refresh()

    async def _learn_next_due(
        self, loop: asyncio.AbstractEventLoop, pool: Connections | None = None
    ) -> None:
        self._checked = loop.time()
        try:
            due_in = await self.next_due_in(pool)
        except Exception as exc:  # only latency and claim cost are at stake: the poll still runs
            log.debug("could not ask when the next job is due (%s)", exc)
            return
        self.delayed = due_in is not None
        if due_in is not None:
            due = loop.time() + due_in
            if self._due_at is None or due < self._due_at:
                self._due_at = due

    def notify(self) -> None:
        """Called by the notifier: there is new work in a queue we serve."""
        self._notified = self._told = True
        self._refresh()
        self.state.wakeup.set()

    async def _wait(self, stopping: asyncio.Event, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.state.wakeup.wait(), timeout)
        except TimeoutError:
            return False
        self.state.wakeup.clear()
        return not stopping.is_set()
