"""The fault scenarios. Each starts workers, feeds jobs, injects its faults (chosen by the run's
seeded generator) and drains; then adds the checks that only it can make."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo

from pgqueue import workflows
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.errors import InvalidJobError
from tests import history
from tests.chaos import app as chaos_app
from tests.chaos.checker import Result
from tests.chaos.harness import Config, Run, wait_for
from tests.chaos.proxy import BlackholeProxy
from tests.helpers import register_worker

Checks = dict[str, bool]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    inject: Callable[[Run], None]
    checks: Callable[[Run, Result], Checks] = lambda run, result: {}
    failures_explain: bool = False
    #: False where every worker can be down at once (poison jobs crash them one after
    #: another), so a reaped job may wait for a restart, not just for its lease.
    recovery_bounded: bool = True


def _steady(
    run: Run, step: Callable[[], None] | None = None, env: dict[str, str] | None = None
) -> None:
    for _ in range(run.config.workers):
        run.start_worker(env)
    run.feed()
    if step is not None:
        run.during_feed(step, run.config.faults)
    run.drain()


def _victim(run: Run, spare: Collection[Any] = ()) -> Any:
    """A worker holding jobs right now (waiting a little for one), else any live worker; none
    of ``spare`` if another will do."""

    def holding() -> list[Any]:
        return [w for w in run.holding() if w not in spare]

    try:
        candidates = wait_for(holding, 2, "a worker holding jobs")
    except TimeoutError:
        candidates = [w for w in run.alive() if w not in spare] or run.alive()
    return run.rng.choice(candidates)


# --- 1. none ------------------------------------------------------------------------------


def none(run: Run) -> None:
    _steady(run)


def none_checks(run: Run, result: Result) -> Checks:
    return {
        "no duplicate execution": result.duplicate_executions == 0,
        "no lease expired": result.zombie_attempts == 0 and not result.recovery,
    }


# --- 2. SIGKILL ---------------------------------------------------------------------------


def sigkill(run: Run) -> None:
    def step() -> None:
        run.kill(_victim(run))
        run.start_worker()

    _steady(run, step)


# --- 3. SIGSTOP past the lease (zombies) ----------------------------------------------------


def _stop_past_the_lease(run: Run, victim: Any) -> None:
    run.fault("SIGSTOP", victim)
    os.kill(victim.proc.pid, signal.SIGSTOP)
    time.sleep(run.rng.uniform(1.5, 2.5) * run.config.lease)
    os.kill(victim.proc.pid, signal.SIGCONT)


def sigstop(run: Run) -> None:
    _steady(run, lambda: _stop_past_the_lease(run, _victim(run)))


def zombie_checks(run: Run, result: Result) -> Checks:
    return {
        "stale writes rejected = zombie attempts": result.stale_rejected == result.zombie_attempts
    }


def cut_off_checks(run: Run, result: Result) -> Checks:
    """A cut-off worker can lose a claim's answer: the claim committed, the reply never came,
    and the jobs it took run under the worker's lease unknown to it until the reaper takes them
    back. Those are zombie attempts with nothing to refuse, so here rejected lies between the
    zombie attempts the worker surely held (their handler logged its start) and all of them."""
    return {
        "zombie attempts that started <= stale writes rejected <= zombie attempts": (
            result.zombie_attempts_started <= result.stale_rejected <= result.zombie_attempts
        )
    }


# --- 4. graceful SIGTERM under load ---------------------------------------------------------


def sigterm(run: Run) -> None:
    codes: list[int] = []

    def step() -> None:
        victim = run.rng.choice(run.alive())
        run.fault("SIGTERM", victim)
        victim.expected_exit = True
        victim.proc.send_signal(signal.SIGTERM)
        codes.append(victim.proc.wait(30))
        run.start_worker()

    _steady(run, step)
    run.extras["exit_codes"] = codes


def sigterm_checks(run: Run, result: Result) -> Checks:
    codes: list[int] = run.extras.get("exit_codes", [])
    return {
        "every SIGTERM exits 0": codes == [0] * len(codes),
        "no lease left to expire": result.zombie_attempts == 0 and not result.recovery,
        "no duplicate execution": result.duplicate_executions == 0,
    }


# --- 5. pg_terminate_backend of each kind of worker connection ------------------------------


def terminate(run: Run) -> None:
    kinds = ["pool", "listen", "handler"]

    def step() -> None:
        for _ in range(3):
            kind = run.rng.choice(kinds)
            rows = run.db.execute(
                "SELECT pid, split_part(application_name, ':', 2)::int FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE %s",
                (f"pgqueue-worker:%:{kind}",),
            ).fetchall()
            if rows:
                backend, worker_pid = run.rng.choice(rows)
                owner = next((w for w in run.workers if w.proc.pid == worker_pid), None)
                run.fault(f"terminate {kind}", owner)
                run.db.execute("SELECT pg_terminate_backend(%s)", (backend,))
            time.sleep(0.2)

    _steady(run, step)


# --- 6. PostgreSQL crash restart under load --------------------------------------------------


def pg_restart(run: Run) -> None:
    def step() -> None:
        run.fault("restart -m immediate")
        run.cluster.restart("immediate")
        run.reconnect()

    _steady(run, step)


def durability_checks(run: Run, result: Result) -> Checks:
    return {"every acknowledged enqueue survived": result.jobs >= run.acknowledged}


# --- 7. network blackhole between one worker and PostgreSQL ---------------------------------


def blackhole(run: Run) -> None:
    proxy = BlackholeProxy("127.0.0.1", run.cluster.port)
    try:
        for _ in range(run.config.workers - 1):
            run.start_worker()
        through = run.start_worker(dsn=conninfo.make_conninfo(run.dsn, port=proxy.port))
        run.feed()

        def step() -> None:
            run.fault("blackhole", through)
            proxy.blackhole()
            time.sleep(run.rng.uniform(1.5, 2.5) * run.config.lease)
            proxy.heal()

        run.during_feed(step, run.config.faults)
        run.drain()
    finally:
        run.stop()
        proxy.close()


# --- 8. reaper vs completion race, forced with the reaper's pause hook ----------------------


def reaper_race(run: Run) -> None:
    q = run.app.q
    backoff = {"backoff_base": 0.05, "backoff_cap": 0.5}
    violations: list[str] = []
    iterations = run.config.faults * 20

    def claim(worker: uuid.UUID) -> uuid.UUID:
        token = uuid.uuid4()
        register_worker(run.db, worker, lease=60)
        (_,) = run.db.execute(
            q.claim_jobs, {"worker_id": worker, "limit": 1, "token": token, "tasks": None}
        ).fetchall()
        return token

    def ack(job_id: int, token: uuid.UUID) -> list[Any]:
        params = {"lock_timeout": "100ms", "ids": [job_id], "tokens": [token], "statuses": ["succeeded"],
                  "delays": [0.0], "errors": [None], "results": [None], "run_seconds": [0.0]}  # fmt: skip
        return run.db.execute(q.complete_jobs, params).fetchall()

    for _ in range(iterations):
        job_id = run.app.enqueue("race", {}, allow_unknown=True)
        token = claim(uuid.uuid4())
        run.db.execute(
            "UPDATE pgqueue_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            (job_id,),
        )
        reaped: list[Any] = []

        def paused_reaper(out: list[Any] = reaped) -> None:
            with psycopg.connect(run.dsn, autocommit=True) as reaper:
                out.extend(reaper.execute(q.reap_expired_leases, {**backoff, "pause": 0.5}))

        thread = threading.Thread(target=paused_reaper)
        thread.start()
        wait_for(
            lambda: run.db.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                " AND datname = current_database()"
            ).fetchone(),
            10,
            "the reaper to pause between finding and locking",
        )
        action = run.rng.choice(["complete", "reclaim", "extend"])
        run.fault(f"race: {action}")
        final = token
        if action == "complete":
            ack(job_id, token)
        elif action == "reclaim":
            run.db.execute(q.reap_expired_leases, {**backoff, "pause": 0.0})
            run.db.execute("UPDATE pgqueue_jobs SET run_at = now() WHERE id = %s", (job_id,))
            final = claim(uuid.uuid4())
        else:
            run.db.execute(
                "UPDATE pgqueue_jobs SET lease_expires_at = now() + interval '60 seconds'"
                " WHERE id = %s",
                (job_id,),
            )
        thread.join(30)
        row = run.db.execute(
            "SELECT status::text, lease_token FROM pgqueue_jobs WHERE id = %s", (job_id,)
        ).fetchone()
        expected = ("succeeded" if action == "complete" else "running", final)
        if reaped or row != expected:
            violations.append(f"{action}: reaper returned {reaped}, row {row}")
        if action != "complete":
            ack(job_id, final)
    run.extras["race_violations"] = violations


def race_checks(run: Run, result: Result) -> Checks:
    violations: list[str] = run.extras.get("race_violations", ["did not run"])
    result.notes.extend(violations[:5])
    return {
        "the paused reaper never touched a completed, re-claimed or extended job": not violations
    }


# --- 9. poison jobs -------------------------------------------------------------------------

POISON = ("exit_process", "hang", "hog")


def poison(run: Run) -> None:
    env = {"PGQUEUE_TEST_MEMORY_LIMIT": str(1 << 30)}

    def step() -> None:
        kind = run.rng.choice(POISON)
        run.fault(f"poison {kind}")
        max_attempts = chaos_app.app.tasks[kind].options.max_attempts
        run.app.enqueue(kind, {}, max_attempts=max_attempts, allow_unknown=True)

    _steady(run, step, env)


def poison_checks(run: Run, result: Result) -> Checks:
    rows = run.db.execute(
        "SELECT task, status::text, attempts, max_attempts, last_error FROM pgqueue_jobs"
        " WHERE task = ANY(%s)",
        (list(POISON),),
    ).fetchall()
    result.notes.extend(
        f"poison {t}: {status} after {n}/{m}: {(e or '')[:120]}" for t, status, n, m, e in rows
    )
    crash_budget = sum(maximum for task, _, _, maximum, _ in rows if task == "exit_process")
    expected_error = {
        "exit_process": "LeaseExpired",
        "hang": "TaskTimeoutError",
        "hog": "MemoryError",
    }
    return {
        "every poison job ends dead after max_attempts": all(
            status == "dead" and attempts == maximum for _, status, attempts, maximum, _ in rows
        ),
        # (or LeaseExpired: a crash poison on the same worker took its last attempt down too)
        "each with the reason it died": all(
            (e or "").startswith((expected_error[t], "LeaseExpired")) for t, *_, e in rows
        ),
        "worker restarts bounded by max_attempts per crashing job": run.restarts <= crash_budget,
    }


# --- 10. worker clocks skewed by minutes ----------------------------------------------------


def clock_skew(run: Run) -> None:
    offsets = ["600", "-600", "0"]
    for n in range(run.config.workers):
        run.start_worker({"PGQUEUE_TEST_CLOCK_OFFSET": offsets[n % 3]})
    run.feed()

    def step() -> None:
        victim = _victim(run)
        run.kill(victim)
        run.start_worker(victim.env)

    run.during_feed(step, 1)
    run.drain()


def skew_checks(run: Run, result: Result) -> Checks:
    # With only killed workers losing leases, any other reap would have been an early one;
    # a late one would break the recovery bound.
    return {"no early reap (only killed workers lost leases)": result.zombie_attempts == 0}


# --- 11. bad rows and bad input -------------------------------------------------------------

ODD_QUEUES = ["émoji-🚀", "עברית", "a'b\"c;--", "q" * 128, "%s%(x)s{}", "tab\there"]
BAD_ROWS = {
    # args, the error the job must end with
    "effect-wrong-args": ("effect", '{"nope": 1}', "unexpected keyword argument"),
    "effect-not-an-object": ("effect", "[1, 2]", "TypeError"),
}


def bad_input(run: Run) -> None:
    for _ in range(run.config.workers):
        run.start_worker()
    run.feed()
    refused: list[bool] = []
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    bad_args: list[dict[str, Any]] = [
        {"s": "\ud800"}, {"s": "a\x00b"}, {"s": "x" * (2 << 20)}, {"d": deep}, {"f": float("nan")}
    ]  # fmt: skip
    for bad in bad_args:
        try:
            run.app.enqueue("effect", bad, allow_unknown=True)
            refused.append(False)
        except InvalidJobError:
            refused.append(True)
    run.extras["api_refusals"] = refused
    for name, (task, args, _) in BAD_ROWS.items():
        run.db.execute(
            "INSERT INTO pgqueue_jobs (queue, task, args, max_attempts) VALUES (%s, %s, %s, 3)",
            (name, task, args),
        )
        run.fault(f"bad row {name}")
    # A 5 MiB payload, past the producer's limit, hand-inserted: it still runs.
    run.db.execute(
        "INSERT INTO pgqueue_jobs (queue, task, args) VALUES ('huge', 'blob', %s::jsonb)",
        (f'{{"data": "{"x" * (5 << 20)}"}}',),
    )
    for queue in ODD_QUEUES:
        run.app.enqueue("effect", {"seconds": 0.0}, queue=queue, allow_unknown=True)
    run.app.enqueue("tâche ✓ عربى 🚀", {}, queue="ünïcode", allow_unknown=True)
    # A task no worker knows (a rolling deploy's newer task): handed back untouched, it waits.
    unknown = run.app.enqueue("no.such.task", {}, queue="unknown-task", allow_unknown=True)
    run.fault("job of an unknown task")
    run.drain(ignore=[unknown])
    run.extras["unknown_task_job"] = run.db.execute(
        "SELECT status::text, attempts, last_error FROM pgqueue_jobs WHERE id = %s", (unknown,)
    ).fetchone()
    run.db.execute("DELETE FROM pgqueue_jobs WHERE id = %s", (unknown,))  # as an operator would


def bad_input_checks(run: Run, result: Result) -> Checks:
    rows = {
        queue: (status, error or "")
        for queue, status, error in run.db.execute(
            "SELECT queue, status::text, last_error FROM pgqueue_jobs WHERE queue = ANY(%s)",
            (list(BAD_ROWS),),
        ).fetchall()
    }
    odd = run.db.execute(
        "SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded' AND queue = ANY(%s)",
        ([*ODD_QUEUES, "huge", "ünïcode"],),
    ).fetchone()
    return {
        "each bad row ends dead with a clear error": all(
            rows.get(name, ("?", ""))[0] == "dead" and expected in rows[name][1]
            for name, (_, _, expected) in BAD_ROWS.items()
        ),
        "odd names and a huge hand-inserted payload run": odd == (len(ODD_QUEUES) + 2,),
        "bad arguments are refused at enqueue": run.extras.get("api_refusals") == [True] * 5,
        "a job of an unknown task waits untouched": run.extras.get("unknown_task_job")
        == ("queued", 0, None),
        "no worker crashed": run.restarts == 0,
    }


# --- 12. job control under SIGKILL: cancels racing acks and reaps, chains, a big group -------

#: The tasks whose jobs ``control`` cancels: effect-writing ones, never the group's.
CANCELLABLE = chaos_app.EFFECT_TASKS


def control(run: Run) -> None:
    """Workers are SIGKILLed while a group of ``group_size`` members drains towards its
    callback, chains of three steps are enqueued, and running and waiting jobs are cancelled
    (running ones often just as they finish: their handlers last 0-0.6 s)."""
    for _ in range(run.config.workers):
        run.start_worker()
    member, summarise, effect = (run.app.tasks[n] for n in ("member", "summarise", "effect"))
    # Below the feed's priority: the feed's jobs keep running (and being cancelled) meanwhile.
    members = (
        workflows.Signature(member, {"n": n}, priority=-1) for n in range(run.config.group_size)
    )
    group = run.app.group(members, then=summarise.s(seconds=1.0))
    run.extras["group"] = group
    run.feed()
    chains: list[list[int]] = []
    cancels: list[tuple[int, str, datetime]] = []

    def step() -> None:
        run.kill(_victim(run))
        run.start_worker()
        steps = [effect.s(seconds=round(run.rng.uniform(0.05, 0.6), 3)) for _ in range(3)]
        chains.append([int(i) for i in run.app.chain(*steps)])
        for status in ("running", "queued", "blocked"):
            targets = run.db.execute(
                "SELECT id FROM pgqueue_jobs WHERE status = %s AND task = ANY(%s)"
                " ORDER BY id DESC LIMIT 3",
                (status, CANCELLABLE),
            ).fetchall()
            for (job_id,) in targets:
                outcome = run.app.cancel(job_id)
                cancels.append((job_id, str(outcome), run.now()))

    run.during_feed(step, run.config.faults)
    # And the callback's own worker while the callback runs (unless it ran during the feed):
    # its one effect must still be written once, by the attempt after the reap.
    assert group.callback is not None
    callback = int(group.callback)

    def callback_running() -> Any:
        row = run.db.execute(
            "SELECT j.status::text, j.worker_id FROM pgqueue_jobs j WHERE j.id = %s AND"
            " (j.status <> 'running' OR EXISTS (SELECT FROM history_runs h"
            "  WHERE h.job_id = j.id AND h.lease_token = j.lease_token))",
            (callback,),
        ).fetchone()
        if row is None or row[0] in ("queued", "retrying", "blocked"):
            return None
        holder = next((w for w in run.alive() if w.id == row[1]), None)
        return (
            holder
            if row[0] == "running" and holder
            else ("finished" if row[0] != "running" else None)
        )

    holder = wait_for(callback_running, run.config.drain_timeout, "the group's callback to run")
    if holder != "finished":
        run.kill(holder)
        run.start_worker()
        run.extras["callback_killed"] = True
    run.drain()
    run.extras["chains"] = chains
    run.extras["cancels"] = cancels
    asked = {job_id for job_id, outcome, _ in cancels if outcome != "already finished"}
    run.cancelled_on_purpose |= asked
    for chain in chains:
        for i, job_id in enumerate(chain):
            if any(parent in asked for parent in chain[: i + 1]):
                run.cancelled_on_purpose.add(job_id)


def control_checks(run: Run, result: Result) -> Checks:
    group = run.extras.get("group")
    if group is None:
        return {"the group was written": False}
    members = [int(m) for m in group.members]
    callback = int(group.callback)
    status, summary = run.db.execute(
        "SELECT status::text, result FROM pgqueue_jobs WHERE id = %s", (callback,)
    ).fetchone() or (None, None)
    ordered = run.db.execute(
        "SELECT (SELECT min(seq) FROM history_transitions WHERE job_id = %s"
        "        AND new_status = 'running')"
        "     > (SELECT max(seq) FROM history_transitions WHERE job_id = ANY(%s)"
        "        AND new_status = 'succeeded'),"
        " (SELECT count(*) FROM pgqueue_jobs WHERE id = ANY(%s) AND status = 'succeeded'),"
        " (SELECT count(*) FROM chaos_effects WHERE job_id = %s),"
        " (SELECT count(*) FROM history_runs WHERE job_id = %s AND event = 'start')",
        (callback, members, members, callback, callback),
    ).fetchone()
    assert ordered is not None
    after_members, succeeded_members, callback_effects, callback_runs = ordered
    chain_ok = True
    for chain in run.extras.get("chains", []):
        for parent, child in itertools.pairwise(chain):
            row = run.db.execute(
                "SELECT (SELECT status::text FROM pgqueue_jobs WHERE id = %(p)s),"
                " (SELECT status::text FROM pgqueue_jobs WHERE id = %(c)s),"
                " (SELECT min(seq) FROM history_transitions WHERE job_id = %(c)s"
                "  AND new_status = 'running'),"
                " (SELECT max(seq) FROM history_transitions WHERE job_id = %(p)s"
                "  AND new_status = 'succeeded')",
                {"p": parent, "c": child},
            ).fetchone()
            assert row is not None
            parent_status, child_status, child_claim, parent_success = row
            if parent_status != "succeeded":
                chain_ok &= child_status == "cancelled" and child_claim is None
            elif child_claim is not None:
                chain_ok &= parent_success is not None and parent_success < child_claim
    result.notes.append(
        f"callback {callback}: {status}, {str(summary)[:80]}, {callback_effects} effect(s),"
        f" {callback_runs} run(s), claimed after the last member: {after_members};"
        f" {succeeded_members:,} of {len(members):,} members succeeded"
    )
    cancels_ok = True
    cancels = run.extras.get("cancels", [])
    for job_id, outcome, after in cancels:
        row = run.db.execute(
            "SELECT status::text, (SELECT count(*) FROM history_transitions WHERE job_id = %(j)s"
            "   AND new_status = 'running' AND at > %(after)s)"
            " FROM pgqueue_jobs WHERE id = %(j)s",
            {"j": job_id, "after": after},
        ).fetchone()
        assert row is not None
        final, claims_after = row
        allowed = {
            "cancelled": {"cancelled"},
            "cancel requested": {"cancelled", "succeeded"},
            "already finished": {"succeeded", "dead", "cancelled"},
        }[outcome]
        if final not in allowed or claims_after:
            cancels_ok = False
            trail = run.db.execute(
                "SELECT old_status, new_status, at, new_worker FROM history_transitions"
                " WHERE job_id = %s ORDER BY seq",
                (job_id,),
            ).fetchall()
            result.notes.append(
                f"job {job_id}: cancel said {outcome!r} at {after}, ended {final},"
                f" {claims_after} claim(s) after: {trail}"
            )
    requested = sum(1 for _, outcome, _ in cancels if outcome == "cancel requested")
    result.notes.append(
        f"{len(members):,} members, {len(cancels)} cancels ({requested} of running jobs),"
        f" {len(run.extras.get('chains', []))} chains"
    )
    return {
        "the group's callback ran once, after every member, with every result in order": (
            status == "succeeded"
            and summary == {"count": len(members), "in_order": True}
            and callback_effects == 1
            and (callback_runs >= 2 or not run.extras.get("callback_killed"))
            and succeeded_members == len(members)
            and bool(after_members)
        ),
        "each chain step ran only after its parent succeeded, or was cancelled with it": chain_ok,
        "a cancelled job ends cancelled (or succeeded first) and is never claimed again": (
            cancels_ok and requested > 0
        ),
    }


# --- 13. slot hand-offs under SIGKILL and SIGSTOP ------------------------------------------


def handoff(run: Run) -> None:
    """The capped queue has a limit alone and is the only limited work (see harness.handoff),
    so the acks of its jobs claim its next ones in their own transaction. Workers are killed
    with hand-offs in flight, or stopped past their lease so that their acks come back stale
    (which must free nothing and hand nothing off); the operator lowers the limit below what
    runs, then raises it. A stopped worker is never killed later: the zombie count leaves
    killed workers out, and their earlier stale writes would then go unmatched. So once every
    live worker has been stopped, the step stops one again rather than kill it (_victim falls
    back to a spared worker when no other is left: with four workers and ten faults, that
    killed a stopped one in about half the runs)."""
    stopped: list[Any] = []

    def step() -> None:
        never_stopped = [w for w in run.alive() if w not in stopped]
        if run.rng.random() < 0.5 and never_stopped:
            run.kill(_victim(run, spare=stopped))
            run.start_worker()
            return
        victim = _victim(run)
        stopped.append(victim)
        _stop_past_the_lease(run, victim)

    _steady(run, step)


def handoff_checks(run: Run, result: Result) -> Checks:
    handed = history.hand_offs(run.db, chaos_app.CAPPED_QUEUE)
    result.notes.append(f"{handed} jobs of the capped queue started by slot hand-offs")
    return {
        **zombie_checks(run, result),
        "slots were handed off": handed > 0,
    }


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("none", "no faults: every job exactly once", none, none_checks),
        Scenario("sigkill", "SIGKILL workers with jobs in flight", sigkill),
        Scenario("sigstop", "SIGSTOP past the lease, then SIGCONT", sigstop, zombie_checks),
        Scenario("sigterm", "graceful SIGTERM under load", sigterm, sigterm_checks),
        Scenario(
            "terminate",
            "pg_terminate_backend of pool, heartbeat, LISTEN, handler connections",
            terminate,
            failures_explain=True,
        ),
        Scenario(
            "pg_restart",
            "PostgreSQL restart -m immediate under load",
            pg_restart,
            durability_checks,
            failures_explain=True,
        ),
        Scenario("blackhole", "network blackhole worker <-> PostgreSQL", blackhole, cut_off_checks),
        Scenario("reaper_race", "reaper paused between find and update", reaper_race, race_checks),
        Scenario(
            "poison",
            "os._exit, hang forever, unbounded allocation",
            poison,
            poison_checks,
            failures_explain=True,
            recovery_bounded=False,
        ),
        Scenario("clock_skew", "worker clocks +-10 min, one killed", clock_skew, skew_checks),
        Scenario(
            "control",
            "cancels racing acks and reaps, chains and a big group, under SIGKILL",
            control,
            control_checks,
        ),
        Scenario(
            "handoff",
            "a limited queue's acks hand its slots off, under SIGKILL and SIGSTOP",
            handoff,
            handoff_checks,
        ),
        Scenario(
            "bad_input",
            "mismatched args, unknown tasks, huge payloads, odd Unicode",
            bad_input,
            bad_input_checks,
            failures_explain=True,
        ),
    ]
}


def run_scenario(cluster: EmbeddedPostgres, config: Config, name: str, logdir: Path) -> Result:
    scenario = SCENARIOS[name]
    logdir.mkdir(parents=True, exist_ok=True)
    run = Run(cluster, config, name, logdir)
    run.failures_explain = scenario.failures_explain
    try:
        # A wait that timed out (most often the drain: jobs that never finish, such as one
        # holding a slot nobody reaps) is a finding like any other: the checks still run, so
        # the table says what was left behind.
        timed_out: str | None = None
        try:
            scenario.inject(run)
        except TimeoutError as exc:
            timed_out = str(exc)
        run.stop()
        result = run.result()
        if not scenario.recovery_bounded:
            del result.checks["recovery within lease + reaper interval"]
        result.checks.update(scenario.checks(run, result))
        if timed_out is not None:
            result.checks["every wait ended in time"] = False
            result.notes.insert(0, f"timed out: {timed_out}")
        if not result.passed:
            result.notes.append(run.logs())
        return result
    finally:
        run.close()
