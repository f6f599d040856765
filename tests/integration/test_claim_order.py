"""Which jobs a claim takes, in which order, and what jobs that are not due yet cost it.

A claim takes the due jobs (queued or retrying, ``run_at <= now()``) in the order
``priority DESC, run_at, id``, skipping rows another session holds, and locks nothing beyond its
batch. Every claim statement does, the plain one and the one a worker uses while jobs wait for a
later run_at: that one walks the distinct priorities instead of the index entries, so delayed jobs
of a higher priority, however many, cost it a few index descents (see claim_jobs_by_priority in
queries.sql). The one a worker uses while a long transaction holds back vacuum
(claim_jobs_after) takes the same, but for the jobs of its bound's priority at or before the
bound; its sweep (claim_jobs_before) takes those, from where its last batch ended.
``next_ready_at`` tells an idle worker how long until the next delayed job is due.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue.sql import queries
from tests.helpers import register_worker, running_worker, wait_until_async
from tests.plans import Conn, buffers, claim_selection, explain

QUEUES = ["a", "b", "c"]
#: Few distinct values, so priorities and run_at tie often; the extremes of int4 included.
PRIORITIES = [-(2**31), -7, 0, 1, 10, 2**31 - 1]
STATUSES = ["queued", "queued", "retrying", "running", "succeeded", "dead"]
#: Seconds from now: due (negative) or delayed (positive), never within a second of the claim.
OFFSETS = [-3600, -60, -1, 1, 60, 3600]


Row = tuple[str, int, str, int, bool]


def job_rows(
    priorities: st.SearchStrategy[int], min_size: int, max_size: int
) -> st.SearchStrategy[list[Row]]:
    return st.lists(
        st.tuples(
            st.sampled_from(QUEUES),
            priorities,
            st.sampled_from(STATUSES),
            st.sampled_from(OFFSETS),
            st.booleans(),  # held by another session while the claim runs
        ),
        min_size=min_size,
        max_size=max_size,
    )


#: A handful of priorities (ties everywhere), and more distinct priorities than the claim walks
#: one by one (32) before it scans the rest.
LAYOUTS = {
    "few priorities": job_rows(st.sampled_from(PRIORITIES), 0, 40),
    "many priorities": job_rows(st.integers(-60, 60), 80, 160),
}
queue_lists = st.one_of(
    st.none(), st.lists(st.sampled_from([*QUEUES, "d"]), min_size=1, max_size=3, unique=True)
)

REFERENCE = """
SELECT id FROM pgqueue_jobs
WHERE status IN ('queued', 'retrying') AND run_at <= now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
ORDER BY priority DESC, run_at, id
"""
#: What claim_jobs_after takes: the same, but for the jobs of the bound's priority at or before
#: the bound (those a claim from the start takes later).
REFERENCE_AFTER = """
SELECT id FROM pgqueue_jobs
WHERE status IN ('queued', 'retrying') AND run_at <= now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
  AND NOT (priority = %(after_priority)s
           AND (run_at, id) <= (%(after_run_at)s::timestamptz, %(after_id)s))
ORDER BY priority DESC, run_at, id
"""
#: What the sweep behind the bound takes (claim_jobs_before): the jobs of the bound's priority
#: strictly between where the sweep's last batch ended and the bound.
REFERENCE_BEFORE = """
SELECT id FROM pgqueue_jobs
WHERE status IN ('queued', 'retrying') AND run_at <= now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
  AND priority = %(after_priority)s
  AND (run_at, id) > (%(from_run_at)s::timestamptz, %(from_id)s)
  AND (run_at, id) < (%(after_run_at)s::timestamptz, %(after_id)s)
ORDER BY priority DESC, run_at, id
"""
#: A bound where some job is (any status: the last claimed job's place), or where none is.
BOUND = """
SELECT priority, run_at::text, id FROM pgqueue_jobs ORDER BY id OFFSET %(n)s LIMIT 1
"""


def fill(conn: Conn, rows: list[Row]) -> list[int]:
    """The rows as jobs (in list order, so ids follow it); their ids. DELETE, not TRUNCATE:
    TRUNCATE's exclusive lock waits for autovacuum to give way (up to deadlock_timeout, 1 s),
    and this table's aggressive autovacuum settings start it between examples; on a loaded
    machine that made a hundred examples outlast the test's timeout."""
    conn.execute("DELETE FROM pgqueue_jobs")
    if not rows:
        return []
    queues, priorities, statuses, offsets, _ = map(list, zip(*rows, strict=True))
    inserted = conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority, status, run_at)"
        " SELECT q, 't', p, s::pgqueue_status, now() + make_interval(secs => o)"
        " FROM unnest(%s::text[], %s::int[], %s::text[], %s::int[]) WITH ORDINALITY"
        "      AS r(q, p, s, o, n) ORDER BY n RETURNING id",
        (queues, priorities, statuses, offsets),
    ).fetchall()
    return sorted(r[0] for r in inserted)


#: The claiming worker: registered (with a live lease) by each test that claims.
WORKER = uuid.uuid4()


def claim_params(limit: int, queues: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "worker_id": WORKER,
        "limit": limit,
        "token": uuid.uuid4(),
        "tasks": None,
    }
    if queues is not None:
        params["queues"] = queues
    return params


@pytest.mark.parametrize("statement", ["plain", "by_priority", "after", "before"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_claims_take_due_jobs_in_order_and_lock_nothing_beyond_the_batch(
    conn: Conn, dsn: str, layout: str, statement: str
) -> None:
    """Against a plain SELECT in claim order, for random mixes of priorities, statuses, due and
    delayed rows, queue lists, and rows held by a concurrent claimer: the same jobs in the same
    order, and the rows locked are exactly the batch; on a generic plan (as a worker's cached
    claim runs) and on a custom one."""
    q = queries("public")
    register_worker(conn, WORKER)
    with psycopg.connect(dsn) as claimer, psycopg.connect(dsn) as other:

        def claim(ids: list[int], held: list[int], limit: int, queues: list[str] | None,
                  mode: str, bound: dict[str, Any]) -> None:  # fmt: skip
            try:
                other.execute("SELECT id FROM pgqueue_jobs WHERE id = ANY(%s) FOR UPDATE", (held,))
                claimer.execute(f"SET LOCAL plan_cache_mode = {mode}".encode())
                if statement == "after":
                    reference = claimer.execute(REFERENCE_AFTER, {"queues": queues, **bound})
                elif statement == "before":
                    reference = claimer.execute(REFERENCE_BEFORE, {"queues": queues, **bound})
                else:
                    reference = claimer.execute(REFERENCE, {"queues": queues})
                expected = [r[0] for r in reference.fetchall() if r[0] not in held][:limit]
                if statement == "by_priority":
                    sql = (
                        q.claim_jobs_by_priority
                        if queues is None
                        else q.claim_jobs_by_priority_in_queues
                    )
                elif statement == "after":
                    sql = q.claim_jobs_after if queues is None else q.claim_jobs_after_in_queues
                elif statement == "before":
                    sql = q.claim_jobs_before if queues is None else q.claim_jobs_before_in_queues
                else:
                    sql = q.claim_jobs if queues is None else q.claim_jobs_in_queues
                params = {**claim_params(limit, queues), **bound}
                claimed = [r[0] for r in claimer.execute(sql, params, prepare=True)]
                assert claimed == expected, mode
                # The other session sees every row but the claimed ones free (its own it holds).
                free = other.execute("SELECT id FROM pgqueue_jobs FOR UPDATE SKIP LOCKED")
                assert set(ids) - {r[0] for r in free} == set(claimed), mode
            finally:
                claimer.rollback()
                other.rollback()

        @settings(max_examples=100, deadline=None, database=None)
        @given(rows=LAYOUTS[layout], limit=st.integers(1, 60), queues=queue_lists,
               at=st.integers(0, 200), since=st.integers(-1, 200))  # fmt: skip
        def same_as_the_plain_select(
            rows: list[Row], limit: int, queues: list[str] | None, at: int, since: int
        ) -> None:
            ids = fill(conn, rows)
            held = [i for i, row in zip(ids, rows, strict=True) if row[4]]
            found = conn.execute(BOUND, {"n": at}).fetchone()
            after_priority, after_run_at, after_id = found or (0, "2000-01-01 00:00:00+00", 0)
            # The sweep's own start: the start of the priority (-1), or where a batch ended.
            swept = conn.execute(BOUND, {"n": since}).fetchone() if since >= 0 else None
            bound = {"after_priority": after_priority, "after_run_at": after_run_at,
                     "after_id": after_id, "from_run_at": swept[1] if swept else "-infinity",
                     "from_id": swept[2] if swept else 0}  # fmt: skip
            for mode in ("force_generic_plan", "force_custom_plan"):
                claim(ids, held, limit, queues, mode, bound)

        same_as_the_plain_select()


DELAYED = 500_000


def test_delayed_jobs_of_higher_priority_cost_a_claim_almost_nothing(conn: Conn) -> None:
    """Half a million delayed jobs above the due ones (two priorities, two queues) cost finding
    and locking a batch a scan of all of them before the fix (4,637 buffers here instead of
    ~230-420; 4,400 and 38 ms a claim in the report); now a few index descents, in every variant
    of the claim a worker uses while such jobs exist (claim_jobs_by_priority), and in the claims
    after a bound (claim_jobs_after, which a worker uses once a claim was slow: before it walked
    the priorities it read 4,644 buffers here instead of ~420, and the `delayed` benchmark's
    drain lost up to a third of its rate whenever a worker entered that mode)."""
    register_worker(conn, WORKER)
    q = queries("public")
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority)"
        " SELECT CASE WHEN g % 2 = 0 THEN 'a' ELSE 'b' END, 't', g % 3 - 1"
        " FROM generate_series(1, 30000) AS g"
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    # A bound in the middle of the due jobs' highest priority: the claims after it take the
    # rest of priority 1 in order.
    row = conn.execute(
        "SELECT priority, run_at::text, id FROM pgqueue_jobs WHERE priority = 1"
        " ORDER BY run_at, id OFFSET 5000 LIMIT 1"
    ).fetchone()
    assert row is not None
    bound = dict(zip(("after_priority", "after_run_at", "after_id"), row, strict=True))
    claims: dict[str, tuple[bytes, list[str] | None, dict[str, Any]]] = {
        "claim_jobs_by_priority": (q.claim_jobs_by_priority, None, {}),
        "in_queues, one queue": (q.claim_jobs_by_priority_in_queues, ["a"], {}),
        "in_queues, two queues": (q.claim_jobs_by_priority_in_queues, ["a", "b"], {}),
        "claim_jobs_after": (q.claim_jobs_after, None, bound),
        "after, one queue": (q.claim_jobs_after_in_queues, ["a"], bound),
        "after, two queues": (q.claim_jobs_after_in_queues, ["a", "b"], bound),
    }

    def cost() -> dict[str, int]:
        found = {}
        for name, (statement, queues, after) in claims.items():
            # The all-queues claim runs on its cached generic plan, the in_queues one on custom ones.
            values = {**claim_params(200, queues), **after}
            plan = explain(conn, statement, values, generic=queues is None)
            assert plan["Actual Rows"] == 200, name
            found[name] = buffers(claim_selection(plan))
        return found

    empty = cost()
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority, run_at)"
        " SELECT CASE WHEN g %% 5 = 0 THEN 'c' ELSE 'a' END, 't', 10 - g %% 2 * 5,"
        "        now() + interval '1 hour' + g * interval '1 ms'"
        " FROM generate_series(1, %s) AS g",
        (DELAYED,),
    )
    conn.execute("VACUUM ANALYZE pgqueue_jobs")
    delayed = cost()
    for name in claims:
        # A deeper index, one descent per priority: a few dozen buffers at most.
        assert delayed[name] <= empty[name] + 60, (name, empty, delayed)


NEXT_READY_REFERENCE = """
SELECT extract(epoch FROM min(run_at) - now())::float8 FROM pgqueue_jobs
WHERE status IN ('queued', 'retrying') AND run_at > now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_next_ready_at_is_the_earliest_future_run_at_among_waiting_jobs(
    conn: Conn, layout: str
) -> None:
    """Against a plain min(run_at) on the same snapshot and clock, for random mixes: the
    earliest delayed job of any priority (of the listed queues), NULL when none is delayed."""
    q = queries("public")

    @settings(max_examples=80, deadline=None, database=None)
    @given(rows=LAYOUTS[layout], queues=queue_lists)
    def same_as_min(rows: list[Row], queues: list[str] | None) -> None:
        fill(conn, rows)
        statement = q.next_ready_at if queues is None else q.next_ready_at_in_queues
        params = {"queues": queues, "lookback": 0}
        with conn.transaction(force_rollback=True):  # one transaction: one now() for both
            (expected,) = conn.execute(NEXT_READY_REFERENCE, params).fetchone() or (None,)
            (found, _) = conn.execute(statement, params).fetchone() or (None, None)
        assert found == expected

    same_as_min()


def test_next_ready_at_counts_the_first_future_job_behind_due_ones(conn: Conn) -> None:
    """Due jobs ahead of a delayed one in the same priority do not hide it; running and
    finished jobs, and other queues with the list variant, do not count."""
    q = queries("public")
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, priority, run_at, status) VALUES"
        " ('a', 't', 5, now() - interval '1 minute', 'queued'),"
        " ('a', 't', 5, now() + interval '90 seconds', 'queued'),"
        " ('a', 't', 9, now() + interval '10 seconds', 'running'),"
        " ('a', 't', 1, now() + interval '1 hour', 'retrying'),"
        " ('b', 't', 1, now() + interval '30 seconds', 'queued')"
    )
    (all_queues, _) = conn.execute(q.next_ready_at, {"lookback": 0}).fetchone() or (None, None)
    assert 25 < all_queues <= 30
    (in_a, _) = conn.execute(
        q.next_ready_at_in_queues, {"queues": ["a"], "lookback": 0}
    ).fetchone() or (None, None)
    assert 85 < in_a <= 90
    (in_c, _) = conn.execute(
        q.next_ready_at_in_queues, {"queues": ["c"], "lookback": 0}
    ).fetchone() or (None, None)
    assert in_c is None


def test_next_ready_at_counts_a_job_that_fell_due_since_the_last_claim(conn: Conn) -> None:
    """A job not yet due for the worker's claim and due by the time it asks next_ready_at must
    not be read past as "due, so not ahead": the worker would sleep until its poll with work
    waiting. With the time since that claim as the lookback it is "due now" (0 or less); with
    none, only jobs still ahead count."""
    q = queries("public")
    conn.execute("INSERT INTO pgqueue_jobs (queue, task, run_at) VALUES ('a', 't', now())")
    (lost, _) = conn.execute(q.next_ready_at, {"lookback": 0}).fetchone() or (None, None)
    assert lost is None  # what the worker saw before: nothing to wait for
    cases: list[tuple[bytes, dict[str, Any]]] = [
        (q.next_ready_at, {"lookback": 5}),
        (q.next_ready_at_in_queues, {"lookback": 5, "queues": ["a"]}),
    ]
    for statement, params in cases:
        (found, _) = conn.execute(statement, params).fetchone() or (None, None)
        assert found is not None and found <= 0


#: Polling once a minute: what happens within seconds was not the poll.
NO_POLL = {"lease": 5.0, "heartbeat_interval": 1.0, "poll_interval": 60.0, "reaper_interval": 1.0}


async def test_a_worker_claims_by_priority_only_while_some_job_waits_for_later(
    app: pgqueue.App,
) -> None:
    """The walk costs the common case (every waiting job due) a little on every claim, and the
    plain scan costs a table with delayed jobs a pass over them: the worker knows which it has,
    from its start, after a short claim, and at most a second late while it is busy."""
    ran: list[int] = []

    @app.task
    async def noop(n: int) -> None:
        ran.append(n)

    later = noop.configure(delay=3600, priority=10).enqueue(n=0)
    async with running_worker(app, **NO_POLL) as worker:
        fetcher = worker.fetcher
        await wait_until_async(lambda: fetcher.delayed)  # asked before its first claim
        noop.enqueue(n=1)
        await wait_until_async(lambda: ran == [1])
        assert fetcher.delayed
        assert app.cancel(later)
        noop.enqueue(n=2)  # its short claim asks again: nothing waits for later now
        await wait_until_async(lambda: ran == [1, 2] and not fetcher.delayed)
        noop.configure(delay=3600).enqueue(n=3)
        noop.enqueue(n=4)
        await wait_until_async(lambda: ran == [1, 2, 4] and fetcher.delayed)
