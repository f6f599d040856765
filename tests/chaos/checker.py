"""After a chaos run: SQL over the jobs, the history and the effects decides pass or fail.

Every figure comes from the database; the harness only adds what it did (which workers it
killed, when each fault began) so that duplicates and recoveries can be attributed. Limits and
rates are checked against what the app declares and the harness set (LimitPlan), from the
trigger log of every lease's start and end (limit_findings), not against the database's values.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg

from tests import history
from tests.chaos.app import Limits

Conn = psycopg.Connection[tuple[Any, ...]]
#: A limit group: ("task", task, key) ('' for a limit over the whole task) or ("queue", name, '').
Group = tuple[str, str, str]


@dataclass
class Fault:
    kind: str
    at: datetime  # database clock
    worker: UUID | None = None


@dataclass(frozen=True)
class LimitChange:
    """An operator's change of a group's limit during the run (None: removed). The harness made
    it between ``before`` and ``after`` on the database clock; its commit is in between."""

    group: Group
    limit: int | None
    before: datetime
    after: datetime


@dataclass
class LimitPlan:
    """The limits a run's jobs must keep: what the app declares per task (tests/chaos/app.py),
    what the harness set on queues, and the changes it made during the run. The checker holds
    the trigger log to these, never to what the database or the workers say the limits are."""

    tasks: Mapping[str, Limits]
    queues: Mapping[str, Limits]
    changes: list[LimitChange] = field(default_factory=list)
    #: Tasks whose handlers write an effect and return their lease token (``effect``'s way).
    effect_tasks: list[str] = field(default_factory=lambda: ["effect"])
    #: Tasks that return their lease token with no effect: the completer acks them.
    acked_tasks: list[str] = field(default_factory=list)


@dataclass
class LimitFindings:
    limited_jobs: int = 0
    #: Starts that filled a group: its limit reached, or its rate's window full.
    at_limit: int = 0
    violations: int = 0
    #: Windows of a rate's period above the rate, by the claims' clock and by the start clock.
    rate_exceeded_claims: int = 0
    rate_exceeded_starts: int = 0
    leaked: int = 0
    misgrouped: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class Result:
    scenario: str
    seed: int
    jobs: int
    faults: int
    lost: int
    duplicate_effects: int
    duplicate_executions: int
    unexplained_duplicates: int
    stale_rejected: int
    stale_accepted: int
    zombie_attempts: int
    #: Zombie attempts whose handler logged its start: the worker surely held those.
    zombie_attempts_started: int
    attempts_exceeded: int
    duplicate_unique: int
    limited_jobs: int
    at_limit: int
    limit_violations: int
    slots_leaked: int
    #: Windows above a rate, by the claims' clock (claimed_at) and by the start clock.
    rate_exceeded: tuple[int, int]
    recovery: list[float]
    recovery_bound: float
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    @property
    def failures(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]

    def recovery_summary(self) -> str:
        if not self.recovery:
            return "-"
        values = sorted(self.recovery)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        return f"{statistics.median(values):.1f} / {p95:.1f} / {values[-1]:.1f} s"


def _one(conn: Conn, query: str, params: Any = None) -> int:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0] or 0)


def lost_jobs(conn: Conn, cancelled_on_purpose: Collection[int]) -> int:
    """Jobs that are neither succeeded nor dead, but those the scenario cancelled on purpose."""
    return _one(
        conn,
        "SELECT count(*) FROM pgqueue_jobs WHERE status NOT IN ('succeeded', 'dead')"
        " AND NOT (status = 'cancelled' AND id = ANY(%s))",
        (sorted(cancelled_on_purpose),),
    )


def _cause(hits: list[datetime], renewed: datetime) -> datetime:
    """Of the faults ``hits`` (in order), the first after a lease's last renewal, else the last
    before it (a renewal in flight as the fault began commits just after it)."""
    return next((at for at in hits if at >= renewed), None) or max(
        (at for at in hits if at < renewed), default=hits[0]
    )


def recovery_times(conn: Conn, faults: list[Fault], lease: float) -> list[float]:
    """For each lease reaped from a faulted worker: seconds from the fault that made it run
    out to the reap, when the job is claimable again. (Its re-run then waits its turn: a retry
    is queued by its new run_at, behind jobs that were due before it.)

    A worker hit several times may renew its lease between faults (it heals, reconnects and
    heartbeats), so the fault that counts is the first one after the lease's last renewal
    (the expiry the reap acted on minus ``lease``), not the first after the claim: from the
    first, a lease renewed after one fault and lost in the next looked like a late reaper.
    A lapse the worker renewed before any reaper took the job is no excuse either: the job
    waited unclaimable from its fault to that renewal, and that wait is a recovery time too
    (a reaper late by more than the bound shows up there)."""
    by_worker: dict[UUID, list[datetime]] = {}
    for fault in faults:
        if fault.worker is not None:
            by_worker.setdefault(fault.worker, []).append(fault.at)
    lapses: dict[UUID, list[tuple[datetime, datetime]]] = {}
    for worker, expired_at, renewed_at in conn.execute(
        "SELECT worker_id, expired_at, renewed_at FROM history_lapses ORDER BY expired_at"
    ).fetchall():
        lapses.setdefault(worker, []).append((expired_at, renewed_at))
    rows = conn.execute(
        "SELECT c.new_worker, c.at, r.at, nullif(r.old_expires, '-infinity') FROM history_reaps r"
        " JOIN history_transitions c ON c.job_id = r.job_id AND c.new_token = r.old_token"
        " AND c.new_status = 'running'"
    ).fetchall()
    renewal = timedelta(seconds=lease)
    times = []
    for worker, claimed_at, reaped_at, expires in rows:
        hits = sorted(at for at in by_worker.get(worker, []) if claimed_at <= at <= reaped_at)
        if not hits:
            continue
        own = [(e, r) for e, r in lapses.get(worker, []) if claimed_at <= e <= reaped_at]
        if expires is None:  # the worker had deregistered: no lease to date the fault by
            expires = hits[0] + renewal
        elif expires > reaped_at:
            # The reaper read a lapsed lease that was renewed before the reap committed: the
            # last lapse before the reap is the expiry it acted on.
            expires = max((e for e, _ in own), default=hits[0] + renewal)
        held = [(e, r) for e, r in own if e < expires and r <= reaped_at]
        times.append((reaped_at - _cause(hits, expires - renewal)).total_seconds())
        times += [(r - _cause(hits, e - renewal)).total_seconds() for e, r in held]
    return times


def _groups(plan: LimitPlan, event: history.LeaseEvent, keys: Mapping[int, str]) -> list[Group]:
    """The limit groups a lease counts in, by the plan: its task's (the key from the job's
    arguments, as the app's limit_key computes it) and its queue's."""
    groups: list[Group] = []
    if event.task in plan.tasks:
        groups.append(("task", event.task, keys.get(event.job_id, event.limit_key or "")))
    if event.queue in plan.queues:
        groups.append(("queue", event.queue, ""))
    return groups


def _declared(plan: LimitPlan, group: Group) -> Limits:
    kind, name, _ = group
    return plan.tasks[name] if kind == "task" else plan.queues[name]


def _allowed(plan: LimitPlan, group: Group, start: history.LeaseEvent) -> int | None:
    """The limit a start had to keep (None: none). A change committed before the claim's
    statement began (``after`` < stmt_at) applied for certain; one that may have committed
    between that and the start (or the declared one before it) may have been what the claim
    read: the start may keep the highest of them."""
    changes = sorted((c for c in plan.changes if c.group == group), key=lambda c: c.after)
    certain = _declared(plan, group).limit
    possible: list[int | None] = []
    for change in changes:
        if change.after < start.stmt_at:
            certain = change.limit
        elif change.before < start.at:
            possible.append(change.limit)
    candidates = [certain, *possible]
    if any(c is None for c in candidates):
        return None
    return max(c for c in candidates if c is not None)


def rate_windows(
    group: Group,
    rate: tuple[int, float],
    starts: list[tuple[history.LeaseEvent, int]],
    notes: list[str],
) -> tuple[int, int, set[int]]:
    """Windows of the rate's period that held more starts than the rate, by two clocks:

    - the claims' own: claim instants t (claimed_at, the claim's now(): what the rate log keeps)
      whose window (t - period, t] holds more starts (a claim counts the log's entries later
      than its now() - period);
    - when the starts happened: a claim decides between the start of its statement (stmt_at)
      and the start's row change (at), so starts whose latest ``at`` is less than a period after
      their earliest ``stmt_at`` were decided within one window, whatever the instants were.
      Counted once per claim statement s: the starts decided no earlier than s (stmt_at) and
      surely within its stmt_at + period (at), when more than the rate. A claim that decides
      and logs by a clock read in its own statement never shows here; one whose clock is older
      (its transaction's start, before a stall) does.

    Returns the windows over the rate by each clock, and the starts (by index) that filled a
    window of the claims' clock to the rate. Notes the worst window of each clock (by the start
    clock: the shortest span, how much too early the last start came)."""
    count, period = rate[0], timedelta(seconds=rate[1])
    filled: set[int] = set()
    by_claim = sorted(starts, key=lambda s: (s[0].claimed_at or s[0].at, s[1]))
    times = [event.claimed_at or event.at for event, _ in by_claim]
    over_claims = 0
    worst_claims: tuple[int, datetime] | None = None
    first = instant = 0
    for last, at in enumerate(times):
        if last + 1 < len(times) and times[last + 1] == at:
            continue  # the window ends after every start of this instant
        while times[first] <= at - period:
            first += 1
        inside = last + 1 - first
        if inside > count:
            over_claims += 1
            if worst_claims is None or inside > worst_claims[0]:
                worst_claims = (inside, at)
        elif inside == count:
            filled.update(index for _, index in by_claim[instant : last + 1])
        instant = last + 1
    by_statement = sorted((event for event, _ in starts), key=lambda e: (e.stmt_at, e.at))
    over_starts = 0
    worst_starts: tuple[int, float, datetime] | None = None
    for i, earliest in enumerate(by_statement):
        if i > 0 and by_statement[i - 1].stmt_at == earliest.stmt_at:
            continue  # one claim statement: its first start stands for the others
        inside = 0
        latest = earliest.at
        for later in by_statement[i:]:
            if later.stmt_at >= earliest.stmt_at + period:
                break
            if later.at < earliest.stmt_at + period:
                inside += 1
                latest = max(latest, later.at)
        if inside > count:
            over_starts += 1
            span = (latest - earliest.stmt_at).total_seconds()
            if worst_starts is None or (-span, inside) > (-worst_starts[1], worst_starts[0]):
                worst_starts = (inside, span, earliest.stmt_at)
    if worst_claims is not None:
        inside, at = worst_claims
        notes.append(
            f"rate exceeded by the claims' clock: {group}, {over_claims} windows of"
            f" {rate[1]:g} s above {count}; the worst, {inside} claimed up to {at.isoformat()}"
        )
    if worst_starts is not None:
        inside, span, at = worst_starts
        notes.append(
            f"rate exceeded by the start clock: {group}, {over_starts} windows of {rate[1]:g} s"
            f" above {count}; the worst, {inside} started within {span:.4f} s from"
            f" {at.isoformat()} ({rate[1] - span:.4f} s short of the period)"
        )
    return over_claims, over_starts, filled


def limit_findings(conn: Conn, plan: LimitPlan) -> LimitFindings:
    """From the trigger log of lease starts and ends (history_leases), swept in clock order:

    - violations: starts after which a group held more leases than its limit in force;
    - rate exceeded: windows of a rate's period holding more starts than the rate, by either
      clock (rate_windows): the claims' own (claimed_at) or when the starts happened;
    - leaked: jobs of limited groups still running with no live lease (after recovery);
    - misgrouped: jobs whose stored limit_key is not the one the app's key function gives.
    """
    found = LimitFindings()
    keys: dict[int, str] = {}
    for job_id, task, args, stored in conn.execute(
        "SELECT id, task, args::text, limit_key FROM pgqueue_jobs WHERE task = ANY(%s)",
        (list(plan.tasks),),
    ).fetchall():
        name = plan.tasks[task].key
        keys[job_id] = "" if name is None else str(json.loads(args).get(name))
        if stored != keys[job_id]:
            found.misgrouped += 1
            if found.misgrouped <= 3:
                found.notes.append(f"job {job_id} ({task}) in group {stored!r}: {keys[job_id]!r}")
    running: dict[Group, set[int]] = defaultdict(set)
    claims: dict[Group, list[tuple[history.LeaseEvent, int]]] = defaultdict(list)
    limited: set[int] = set()
    full: set[int] = set()  # starts (by index) that filled a group's limit or rate
    lag: timedelta | None = None
    for index, event in enumerate(history.lease_events(conn)):
        groups = _groups(plan, event, keys)
        if not groups:
            continue
        limited.add(event.job_id)
        if event.event == "end":
            for group in groups:
                running[group].discard(event.job_id)
            continue
        if event.claimed_at is not None:
            lag = max(lag or timedelta(0), event.at - event.claimed_at)
        for group in groups:
            if _declared(plan, group).rate is not None:
                claims[group].append((event, index))
            holding = running[group]
            holding.add(event.job_id)
            allowed = _allowed(plan, group, event)
            if allowed is None:
                continue
            if len(holding) == allowed:
                full.add(index)
            elif len(holding) > allowed:
                found.violations += 1
                if len(found.notes) < 8:
                    found.notes.append(
                        f"limit violation: {group} held {len(holding)} leases (limit {allowed})"
                        f" at {event.at.isoformat()}: jobs {sorted(holding)}"
                    )
    for group, starts in claims.items():
        rate = _declared(plan, group).rate
        assert rate is not None
        by_claims, by_starts, filled = rate_windows(group, rate, starts, found.notes)
        found.rate_exceeded_claims += by_claims
        found.rate_exceeded_starts += by_starts
        full.update(filled)
    if lag is not None:
        # How long the slowest claim of a limited job took from its claimed_at (its
        # transaction's start) to the start: what a claim deciding by that clock misses.
        found.notes.append(f"slowest limited claim: {lag.total_seconds():.3f} s from claimed_at")
    leaked = history.running_without_lease(conn, list(plan.queues))
    found.leaked = len(leaked)
    if leaked:
        found.notes.append(f"running without a live lease (job, task, group): {leaked[:5]}")
    found.limited_jobs = len(limited)
    found.at_limit = len(full)
    return found


def check(
    conn: Conn,
    *,
    scenario: str,
    seed: int,
    faults: list[Fault],
    killed: set[UUID],
    recovery_bound: float,
    lease: float,
    failures_explain: bool,
    limits: LimitPlan,
    cancelled_on_purpose: Collection[int] = (),
) -> Result:
    jobs = _one(conn, "SELECT count(*) FROM pgqueue_jobs")
    effect_tasks = limits.effect_tasks
    duplicate_effects = _one(
        conn,
        "SELECT coalesce(sum(n - 1), 0) FROM"
        " (SELECT count(*) AS n FROM chaos_effects GROUP BY job_id) per_job",
    ) + _one(
        conn,
        "SELECT count(*) FROM chaos_effects e JOIN pgqueue_jobs j ON j.id = e.job_id"
        " WHERE j.status <> 'succeeded'",
    )
    missing_effects = _one(
        conn,
        "SELECT count(*) FROM pgqueue_jobs j WHERE j.task = ANY(%s) AND j.status = 'succeeded'"
        " AND NOT EXISTS (SELECT 1 FROM chaos_effects e WHERE e.job_id = j.id)",
        (effect_tasks,),
    )
    # A stale write that got in would leave an effect, or a result, of an attempt that was not
    # the job's last claim. (A finished row keeps the token of the attempt that finished it.)
    stale_accepted = _one(
        conn,
        """
        WITH last_claim AS (
            SELECT DISTINCT ON (job_id) job_id, new_token AS token FROM history_transitions
            WHERE new_status = 'running' ORDER BY job_id, seq DESC
        )
        SELECT (SELECT count(*) FROM chaos_effects e JOIN last_claim l USING (job_id)
                WHERE e.lease_token <> l.token)
             + (SELECT count(*) FROM pgqueue_jobs j JOIN last_claim l ON l.job_id = j.id
                WHERE j.task = ANY(%s) AND j.status = 'succeeded'
                  AND (j.result #>> '{}') IS DISTINCT FROM l.token::text)
        """,
        ([*effect_tasks, *limits.acked_tasks],),
    )
    # Zombie attempts: reaped claims of workers that were not killed (stopped, cut off), in
    # claim order, each with whether its handler logged its start.
    zombies = conn.execute(
        "SELECT r.job_id, c.at, c.new_worker, c.new_token, r.at, EXISTS (SELECT FROM history_runs s"
        " WHERE s.job_id = r.job_id AND s.lease_token = r.old_token AND s.event = 'start')"
        " FROM history_reaps r"
        " JOIN history_transitions c ON c.job_id = r.job_id AND c.new_token = r.old_token"
        " AND c.new_status = 'running'"
        " WHERE NOT (c.new_worker = ANY(%s)) ORDER BY c.at",
        (list(killed),),
    ).fetchall()
    zombie_attempts = len(zombies)
    zombie_attempts_started = sum(1 for *_, started in zombies if started)
    unexplained = history.unexplained_duplicates(conn, failures_explain=failures_explain)
    recovery = recovery_times(conn, faults, lease)
    limited = limit_findings(conn, limits)
    result = Result(
        scenario=scenario,
        seed=seed,
        jobs=jobs,
        faults=len(faults),
        lost=lost_jobs(conn, cancelled_on_purpose),
        duplicate_effects=duplicate_effects,
        duplicate_executions=history.duplicate_executions(conn),
        unexplained_duplicates=len(unexplained),
        stale_rejected=_one(conn, "SELECT coalesce(sum(lost), 0) FROM pgqueue_stats"),
        stale_accepted=stale_accepted,
        zombie_attempts=zombie_attempts,
        zombie_attempts_started=zombie_attempts_started,
        attempts_exceeded=_one(
            conn, "SELECT count(*) FROM pgqueue_jobs WHERE attempts > max_attempts"
        ),
        duplicate_unique=history.duplicate_unique_jobs(conn),
        limited_jobs=limited.limited_jobs,
        at_limit=limited.at_limit,
        limit_violations=limited.violations,
        slots_leaked=limited.leaked,
        rate_exceeded=(limited.rate_exceeded_claims, limited.rate_exceeded_starts),
        recovery=recovery,
        recovery_bound=recovery_bound,
    )
    result.checks = {
        "no job lost": result.lost == 0,
        "no duplicate effect": result.duplicate_effects == 0,
        "every success has its effect": missing_effects == 0,
        "no stale write accepted": result.stale_accepted == 0,
        "attempts within max_attempts": result.attempts_exceeded == 0,
        "no two jobs held one unique key at once": result.duplicate_unique == 0,
        "no group held more leases than its limit": result.limit_violations == 0,
        "no slot held without a live lease after recovery": result.slots_leaked == 0,
        "no group started more than its rate in any window": result.rate_exceeded == (0, 0),
        "every limited job in the group of its key": limited.misgrouped == 0,
        "every duplicate explained by a lost lease": result.unexplained_duplicates == 0,
        "recovery within lease + reaper interval": all(t <= recovery_bound for t in recovery),
    }
    if unexplained:
        result.notes.append(f"unexplained re-claims (job, token): {unexplained[:5]}")
        result.notes.extend(history.describe_jobs(conn, [job for job, _ in unexplained[:3]]))
    result.notes.extend(limited.notes)
    if result.stale_rejected != result.zombie_attempts:
        result.notes.append(
            f"zombie attempts: {zombie_attempts} ({zombie_attempts_started} started);"
            f" stale writes rejected: {result.stale_rejected}"
        )
        result.notes.extend(zombie_lines(conn, zombies[:60]))
    return result


def zombie_lines(conn: Conn, zombies: list[Any]) -> list[str]:
    """One line per zombie attempt, for a failure note: its claim (and how many jobs that claim
    took), whether its handler started, when it was reaped. A zombie attempt with no stale
    write to match is then seen for what it was."""
    sizes: dict[Any, int] = dict(
        conn.execute(
            "SELECT new_token, count(*) FROM history_transitions"
            " WHERE new_status = 'running' AND new_token = ANY(%s) GROUP BY new_token",
            ([token for _, _, _, token, _, _ in zombies],),
        ).fetchall()
    )
    return [
        f"zombie attempt: job {job} claimed {claimed:%H:%M:%S.%f} by worker {worker}"
        f" (its claim took {sizes.get(token)}), {'started' if started else 'never started'},"
        f" reaped {reaped:%H:%M:%S.%f}"
        for job, claimed, worker, token, reaped, started in zombies
    ]
