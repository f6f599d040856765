"""Loads the named statements of ``queries.sql`` once per schema.

Statements are rendered to bytes up front (schema quoted with ``sql.Identifier``), so the hot path
passes the same object every time and psycopg's prepared-statement cache recognises it.
"""

from __future__ import annotations

import dataclasses
import re
from functools import cache
from importlib import resources

from psycopg import sql

from .db import channel_for, done_channel_for, validate_schema

_SECTION = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def render(text: str, schema: str, **fragments: str) -> bytes:
    """Substitute the quoted schema and channel, and any SQL ``fragments`` (constant text of
    ours, never values), into a statement or migration."""
    names = {
        "schema": sql.Identifier(validate_schema(schema)),
        "channel": sql.Literal(channel_for(schema)),
        "done_channel": sql.Literal(done_channel_for(schema)),
    }
    composed = sql.SQL(text).format(
        **names,
        **{name: sql.SQL(fragment).format(**names) for name, fragment in fragments.items()},
    )
    return composed.as_string().encode()


#: The fragments that restrict the claims and next_ready_at to a list of queues: the walk over
#: the priorities (claim_jobs_by_priority, next_ready_at) probes each listed queue
#: (``queue_list``, ``queue_match``: an equality, which pgqueue_jobs_ready_queue_idx scans in
#: order), and the rows read are those of any listed queue (``queue_filter``; for a single queue
#: the custom plan folds its second condition into ``queue = 'name'``, an equality again).
#: Paused queues cost no read (see claim_jobs): the walk leaves them out by a check on the
#: listed name, made before its descent, and the row filter's last condition is a one-time
#: filter, so a worker whose every queue is paused (or limited: claim_limited_jobs takes those)
#: reads no row rather than skip them all.
IN_QUEUES = {
    "queue_list": "unnest(%(queues)s::text[])",
    "queue_match": "AND queue = l.queue"
    " AND l.queue <> ALL(ARRAY(SELECT name FROM {schema}.pgqueue_queues WHERE paused))",
    "queue_filter": "AND queue = ANY(%(queues)s::text[])"
    " AND (cardinality(%(queues)s::text[]) > 1 OR queue = (%(queues)s::text[])[1])"
    " AND NOT (%(queues)s::text[] <@ ARRAY(SELECT name FROM {schema}.pgqueue_queues"
    " WHERE paused OR concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL))",
    "limited_queue_match": "AND name = ANY(%(queues)s::text[])",
}
#: claim_jobs as the fetcher's sweep (claim_jobs_before): what claim_jobs_after misses, the jobs
#: of its bound's priority that became ready behind the bound (a released or reaped job, a past
#: run_at, a resumed queue, a producer's transaction that committed after later ones), claimed on
#: a connection of its own, off the claim path (fetcher.py). Its walk from the start of that
#: priority visits every entry a held snapshot keeps (the cost claim_jobs_after avoids), so it
#: runs once a period, and from where its last batch ended (from_run_at, from_id: -infinity and 0
#: for the start) when that came back full: one ordered range scan of pgqueue_jobs_ready_idx
#: between the two row comparisons. Its rows end with their place in claim order, as
#: claim_jobs_after's do.
SWEEP = {
    "sweep_range": "AND priority = %(after_priority)s::int"
    " AND (run_at, id) > (%(from_run_at)s::timestamptz, %(from_id)s::bigint)"
    " AND (run_at, id) < (%(after_run_at)s::timestamptz, %(after_id)s::bigint)",
    "position_columns": ", priority, run_at::text",
}
#: wake_waiting_workers' look, also made by complete_jobs_waking: a NOTIFY per queue in
#: %(queues)s, only while some worker waits for work (migration 0004's lock).
WAKE_LOOK = (
    "SELECT pg_notify({channel}, q.queue)"
    " FROM (SELECT DISTINCT unnest(%(queues)s::text[]) AS queue) q"
    " WHERE NOT (SELECT CASE WHEN pg_try_advisory_lock(hashtext({channel}), 1)"
    " THEN pg_advisory_unlock(hashtext({channel}), 1) ELSE false END)"
)
#: Statements written once in queries.sql and rendered twice: the variant's name → its base
#: section and the fragments it fills in. In the base each fragment is empty unless BASE names it.
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "claim_jobs_in_queues": ("claim_jobs", {**IN_QUEUES, "claim_limit": "%(limit)s"}),
    "claim_jobs_by_priority_in_queues": (
        "claim_jobs_by_priority",
        {**IN_QUEUES, "claim_limit": "%(limit)s"},
    ),
    "claim_jobs_after_in_queues": ("claim_jobs_after", {**IN_QUEUES, "claim_limit": "%(limit)s"}),
    "claim_jobs_before": ("claim_jobs", SWEEP),
    "claim_jobs_before_in_queues": (
        "claim_jobs",
        {**IN_QUEUES, "claim_limit": "%(limit)s", **SWEEP},
    ),
    "next_ready_at_in_queues": ("next_ready_at", IN_QUEUES),
    "claim_dry_position_in_queues": ("claim_dry_position", IN_QUEUES),
    "complete_jobs_skip_locked": (
        "complete_jobs",
        {
            "lock_filter": "AND a.id = ANY(ARRAY(SELECT l.id FROM {schema}.pgqueue_jobs l"
            " WHERE l.id = ANY(%(ids)b::bigint[]) ORDER BY l.id FOR UPDATE SKIP LOCKED))"
        },
    ),
    # The ack that also wakes the workers waiting for the slots it frees, and the ack in a
    # handler's own transaction, which bounds the wait for its COMMIT (see complete_jobs).
    "complete_jobs_waking": (
        "complete_jobs",
        {
            "woke": f", woke AS ({WAKE_LOOK})",
            "woke_gate": " WHERE (SELECT count(*) FROM woke) >= 0",
        },
    ),
    "complete_jobs_in_transaction": (
        "complete_jobs",
        {"ack_idle": " || set_config('idle_in_transaction_session_timeout', %(idle)s, true)"},
    ),
    # regroup_leases for the rows it found locked: waits for them (under a lock_timeout).
    "regroup_leases_waiting": (
        "regroup_leases",
        {
            "regroup_skip": "",
            "regroup_wait": "AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true))"
            " IS NOT NULL",
        },
    ),
    # Dead jobs have a retention of their own (dead_retention), hence a statement of their own.
    "prune_dead_jobs": ("prune_finished_jobs", {"pruned_statuses": "'dead'"}),
    "archive_dead_jobs": ("archive_finished_jobs", {"pruned_statuses": "'dead'"}),
}
#: Which jobs an operator's search or bulk action takes (pgqueue.operations.JobFilter): each
#: part NULL matches any. since/older_than compare when the job finished, or was enqueued if it
#: has not.
JOB_FILTER = (
    "(%(task)s::text IS NULL OR task = %(task)s)"
    " AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
    " AND (%(statuses)s::text[] IS NULL OR status::text = ANY(%(statuses)s::text[]))"
    " AND (%(since)s::float8 IS NULL"
    " OR COALESCE(finished_at, created_at) >= now() - make_interval(secs => %(since)s))"
    " AND (%(older_than)s::float8 IS NULL"
    " OR COALESCE(finished_at, created_at) < now() - make_interval(secs => %(older_than)s))"
)
#: The two claims from the head of the queue (lock_head_groups, claim_head_jobs) build the same
#: lookups: the running jobs per limit group (named as in pgqueue_rates, limits.group_name), and
#: the concurrency limit of each task the head serves (a limit and no rate).
HEAD_LOOKUPS = {
    "held_slots": "SELECT jsonb_object_agg('t:' || length(task) || ':' || task || ':' || limit_key,"
    " n) AS n FROM (SELECT task, limit_key, count(*) AS n FROM {schema}.pgqueue_jobs"
    " WHERE status = 'running' AND limit_key IS NOT NULL GROUP BY task, limit_key) r",
    "head_limits": "SELECT jsonb_object_agg(t.name, t.concurrency_limit) AS l"
    " FROM {schema}.pgqueue_tasks t WHERE t.concurrency_limit IS NOT NULL AND t.rate_limit IS NULL",
}
#: The limited claims' update (claim_limited_jobs, claim_head_jobs): the jobs of ``taken`` start
#: under a new lease token, only while the worker's own lease is live at this statement.
LIMITED_CLAIMED = (
    "UPDATE {schema}.pgqueue_jobs j SET status = 'running', attempts = j.attempts + 1,"
    " lease_token = %(token)s, lease_expires_at = NULL, worker_id = %(worker_id)s,"
    " claimed_at = statement_timestamp(), started_at = NULL"
    " WHERE j.id = ANY(ARRAY(SELECT id FROM taken))"
    " AND EXISTS (SELECT FROM {schema}.pgqueue_workers w WHERE w.id = %(worker_id)s"
    " AND w.lease_expires_at > statement_timestamp())"
    " RETURNING j.id, j.queue, j.task, j.limit_key, j.args, j.attempts, j.max_attempts,"
    " extract(epoch FROM now() - j.run_at)::float8 w, j.priority, j.run_at, j.meta"
)
#: The base rendering's fragments (see claim_jobs for why its LIMIT is a subquery).
BASE = {
    "job_filter": JOB_FILTER,
    **{name: "" for _, fragments in VARIANTS.values() for name in fragments},
    "claim_limit": "(SELECT %(limit)s::int)",
    "regroup_skip": "SKIP LOCKED",
    **HEAD_LOOKUPS,
    "limited_claimed": LIMITED_CLAIMED,
    "wake_look": WAKE_LOOK,
    "queue_list": "(VALUES (NULL::text))",  # one probe per priority, for every queue at once
    "pruned_statuses": "'succeeded', 'cancelled'",
}


def load_sections(package: str = "pgqueue", filename: str = "queries.sql") -> dict[str, str]:
    """The ``-- name:`` sections of a packaged SQL file (the dashboard keeps its own file),
    without their comment lines and indentation: those document the file, and psycopg parses a
    statement longer than 4 KB again at every execution (its query cache skips such
    statements), which cost the claim ~1 us of the worker's CPU per job once its comments
    outgrew that. (No statement holds a string literal that spans lines.)"""
    text = resources.files(package).joinpath(filename).read_text("utf-8")
    parts = _SECTION.split(text)
    return {
        name: "\n".join(
            line.strip() for line in body.strip().splitlines() if not line.lstrip().startswith("--")
        )
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def _sections() -> dict[str, str]:
    return load_sections()


@dataclasses.dataclass(frozen=True, slots=True)
class Queries:
    insert_job: bytes
    insert_child_job: bytes
    insert_group_members: bytes
    parent_results: bytes
    insert_unique_job: bytes
    insert_unique_jobs: bytes
    insert_coalesced_jobs: bytes
    release_unique_keys: bytes
    copy_jobs: bytes
    database_now: bytes
    database_now_bounded: bytes
    announce_waiting: bytes
    withdraw_waiting: bytes
    enqueuers_settled: bytes
    job_attempts: bytes
    get_job: bytes
    requeue_job: bytes
    cancel_job: bytes
    find_jobs: bytes
    count_jobs: bytes
    bulk_batch: bytes
    begin_audit: bytes
    end_audit: bytes
    audit_log: bytes
    retry_now: bytes
    status_counts: bytes
    pause_queue: bytes
    resume_queue: bytes
    paused_queues: bytes
    set_queue_limits: bytes
    queue_settings: bytes
    declare_task_limits: bytes
    set_task_limits: bytes
    reset_task_limits: bytes
    task_limits: bytes
    served_queues: bytes
    snapshot_horizon: bytes
    horizon_passed: bytes
    unstamped_jobs: bytes
    stamp_limit_keys: bytes
    unstamped_among: bytes
    claim_jobs: bytes
    claim_jobs_in_queues: bytes
    claim_jobs_by_priority: bytes
    claim_jobs_by_priority_in_queues: bytes
    claim_jobs_after: bytes
    claim_jobs_after_in_queues: bytes
    claim_jobs_before: bytes
    claim_jobs_before_in_queues: bytes
    claim_position: bytes
    claim_dry_position: bytes
    claim_dry_position_in_queues: bytes
    vacuum_horizon_holder: bytes
    begin_limited_claim: bytes
    limit_claim_settings: bytes
    lock_limit_groups: bytes
    claim_limited_jobs: bytes
    lock_head_groups: bytes
    claim_head_jobs: bytes
    next_ready_at: bytes
    next_ready_at_in_queues: bytes
    complete_jobs: bytes
    complete_jobs_skip_locked: bytes
    complete_jobs_waking: bytes
    complete_jobs_in_transaction: bytes
    hand_off_queue_slots: bytes
    notify_finished: bytes
    announce_result_wait: bytes
    lock_awaited_job: bytes
    applied_completions: bytes
    release_leases: bytes
    regroup_leases: bytes
    regroup_leases_waiting: bytes
    extend_leases: bytes
    save_progress: bytes
    untracked_jobs: bytes
    register_worker: bytes
    deregister_worker: bytes
    worker_fleet: bytes
    reap_expired_leases: bytes
    end_lapsed_sessions: bytes
    expire_leases: bytes
    wake_waiting_workers: bytes
    prune_workers: bytes
    prune_rates: bytes
    prune_finished_jobs: bytes
    prune_dead_jobs: bytes
    archive_finished_jobs: bytes
    archive_dead_jobs: bytes
    archive_partitions: bytes
    # schedules
    lock_schedule_sync: bytes
    schedule_owners: bytes
    upsert_schedules: bytes
    undeclared_schedules: bytes
    retire_schedules: bytes
    transfer_schedules: bytes
    lock_due_schedules: bytes
    insert_schedule_jobs: bytes
    advance_schedules: bytes
    seconds_until_next_schedule: bytes
    list_schedules: bytes
    pause_schedule: bytes
    lock_schedule: bytes
    resume_schedule: bytes


@cache
def queries(schema: str) -> Queries:
    sections = _sections()
    names = {f.name for f in dataclasses.fields(Queries)}
    if set(sections) | set(VARIANTS) != names:
        raise RuntimeError(
            f"queries.sql and Queries disagree: {sorted((set(sections) | set(VARIANTS)) ^ names)}"
        )
    rendered = {name: render(body, schema, **BASE) for name, body in sections.items()}
    for name, (base, fragments) in VARIANTS.items():
        rendered[name] = render(sections[base], schema, **{**BASE, **fragments})
    return Queries(**rendered)


@cache
def named(package: str, filename: str, schema: str) -> dict[str, bytes]:
    """Every section of a packaged SQL file, rendered for one schema (loaded once)."""
    return {name: render(body, schema) for name, body in load_sections(package, filename).items()}
