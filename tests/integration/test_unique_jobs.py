"""Unique jobs against a real PostgreSQL: the rule of each state, the answer the caller gets
(sync, async, in the caller's transaction, in bulk), replace and debounce, and races between
producers that only the database can settle."""

from __future__ import annotations

import asyncio
import multiprocessing
from datetime import timedelta
from typing import Any, cast

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue import ConfigurationError, InvalidJobError
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


def jobs_with(conn: Conn, task: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, status::text, args, unique_key FROM pgqueue_jobs WHERE task = %s ORDER BY id",
        (task,),
    ).fetchall()


def set_status(conn: Conn, job_id: int, status: str, finished_ago: float = 0.0) -> None:
    """Move a job as a worker would (the rule is checked by the next enqueue, whoever moved it)."""
    conn.execute(
        "UPDATE pgqueue_jobs SET status = %s::pgqueue_status,"
        " finished_at = CASE WHEN %s IN ('succeeded', 'dead', 'cancelled')"
        "   THEN now() - make_interval(secs => %s) END WHERE id = %s",
        (status, status, finished_ago, job_id),
    )


def test_a_second_job_with_the_same_arguments_is_answered_with_the_first(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=True)
    def sync_user(user: int) -> None: ...

    first = sync_user.enqueue(user=1)
    second = sync_user.enqueue(user=1)
    other = sync_user.enqueue(user=2)
    assert (first.duplicate, second.duplicate, other.duplicate) == (False, True, False)
    assert second == first and second.id == first.id and other != first
    assert [row[0] for row in jobs_with(conn, "sync_user")] == [first, other]
    job = app.get_job(first)
    assert job is not None and job.unique_key is not None
    assert job.unique_key.startswith("sync_user:")


async def test_the_async_producer_gives_the_same_answer(app: pgqueue.App, conn: Conn) -> None:
    @app.task(unique=True)
    async def sync_user(user: int) -> None: ...

    try:
        first = await sync_user.enqueue_async(user=1)
        second = await app.enqueue_async("sync_user", {"user": 1})
        assert not first.duplicate and second.duplicate and second == first
    finally:
        await app.aclose()
    assert len(jobs_with(conn, "sync_user")) == 1


def test_a_caller_given_key_ignores_the_arguments_and_is_per_task(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task
    def deliver(body: str) -> None: ...

    @app.task
    def audit(body: str) -> None: ...

    first = deliver.configure(unique_key="delivery-42").enqueue(body="a")
    again = app.enqueue("deliver", {"body": "b"}, unique_key="delivery-42")
    elsewhere = audit.configure(unique_key="delivery-42").enqueue(body="a")
    plain = deliver.enqueue(body="a")  # no key: not unique
    assert again.duplicate and again == first
    assert not elsewhere.duplicate and not plain.duplicate
    assert [r[2] for r in jobs_with(conn, "deliver")] == [{"body": "a"}, {"body": "a"}]


def test_named_arguments_and_a_key_function_choose_what_makes_jobs_the_same(
    app: pgqueue.App,
) -> None:
    @app.task(unique=["user"])
    def by_user(user: int, reason: str) -> None: ...

    @app.task(unique=lambda args: f"tenant-{args['tenant']}")
    def by_tenant(tenant: str, n: int) -> None: ...

    assert by_user.enqueue(user=1, reason="x") == by_user.enqueue(user=1, reason="y")
    assert not by_user.enqueue(user=2, reason="x").duplicate
    assert by_tenant.enqueue(tenant="a", n=1) == by_tenant.enqueue(tenant="a", n=2)
    assert not by_tenant.enqueue(tenant="b", n=1).duplicate
    assert not by_user.configure(unique=False).enqueue(user=1, reason="x").duplicate


# The rule: in which states of the first job a second one is refused.
HOLDS = {
    # (unique_while, unique_for given) -> states in which the key holds
    ("waiting", False): {"queued", "retrying"},
    ("active", False): {"queued", "retrying", "running"},
    ("waiting", True): {"queued", "retrying", "succeeded"},
    ("active", True): {"queued", "retrying", "running", "succeeded"},
}
STATUSES = ["queued", "running", "retrying", "succeeded", "dead", "cancelled"]
#: unique_while given as the states it names, in any order and collection.
AS_STATES = {"waiting": ["retrying", "queued"], "active": ("running", "queued", "retrying")}


@pytest.mark.parametrize("as_states", [False, True], ids=["named", "as-states"])
@pytest.mark.parametrize(("rule", "holds"), sorted(HOLDS.items()))
def test_each_rule_refuses_a_second_job_exactly_in_its_states(
    app: pgqueue.App, conn: Conn, rule: tuple[str, bool], holds: set[str], as_states: bool
) -> None:
    unique_while, after_success = rule
    spelled = AS_STATES[unique_while] if as_states else unique_while

    @app.task(
        unique=True, unique_while=cast(Any, spelled), unique_for=60 if after_success else None
    )
    def work(n: int) -> None: ...

    for n, status in enumerate(STATUSES):
        first = work.enqueue(n=n)
        set_status(conn, first, status)
        second = work.enqueue(n=n)
        assert second.duplicate == (status in holds), (rule, status)
        assert (second == first) == (status in holds)


def test_the_key_holds_for_unique_for_after_success_and_then_frees(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=True, unique_for=timedelta(minutes=10))
    def report(day: str) -> None: ...

    first = report.enqueue(day="mon")
    set_status(conn, first, "succeeded", finished_ago=9 * 60)
    assert report.enqueue(day="mon").duplicate
    set_status(conn, first, "succeeded", finished_ago=11 * 60)  # on the database clock
    later = report.enqueue(day="mon")
    assert not later.duplicate and later != first
    # The finished job lost its key to the new one, which now holds it.
    assert [(r[0], r[3] is not None) for r in jobs_with(conn, "report")] == [
        (first, False),
        (later, True),
    ]


def test_replace_takes_the_new_arguments_while_the_first_job_waits(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=["user"], on_conflict="replace")
    def refresh(user: int, fields: list[str]) -> None: ...

    first = refresh.configure(delay=30).enqueue(user=1, fields=["a"])
    run_at = conn.execute("SELECT run_at FROM pgqueue_jobs WHERE id = %s", (first,)).fetchone()
    again = refresh.configure(priority=5).enqueue(user=1, fields=["a", "b"])
    assert again == first and again.duplicate and again.replaced
    assert conn.execute(
        "SELECT args, priority, run_at FROM pgqueue_jobs WHERE id = %s", (first,)
    ).fetchone() == ({"user": 1, "fields": ["a", "b"]}, 5, run_at[0] if run_at else None)
    set_status(conn, first, "running")
    late = refresh.enqueue(user=1, fields=["z"])
    assert late == first and late.duplicate and not late.replaced  # a running job is left alone
    assert jobs_with(conn, "refresh")[0][2] == {"user": 1, "fields": ["a", "b"]}


def test_debounce_pushes_the_waiting_job_later_and_never_earlier(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=["doc"], on_conflict="debounce")
    def reindex(doc: int, version: int) -> None: ...

    def delay_of(job_id: int) -> float:
        row = conn.execute(
            "SELECT extract(epoch FROM run_at - now())::float8 FROM pgqueue_jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
        assert row is not None
        return float(row[0])

    first = reindex.configure(delay=10).enqueue(doc=1, version=1)
    pushed = reindex.configure(delay=100).enqueue(doc=1, version=2)
    assert pushed == first and pushed.replaced
    assert 90 < delay_of(first) <= 100
    earlier = reindex.configure(delay=5).enqueue(doc=1, version=3)
    assert earlier == first and earlier.replaced
    assert 90 < delay_of(first) <= 100  # never pulled earlier
    assert jobs_with(conn, "reindex")[0][2] == {"doc": 1, "version": 3}


def test_in_the_callers_transaction_the_job_and_its_key_exist_only_if_it_commits(
    app: pgqueue.App, dsn: str, conn: Conn
) -> None:
    @app.task(unique=True)
    def charge(order: int) -> None: ...

    with psycopg.connect(dsn) as tx:
        first = charge.configure(connection=tx).enqueue(order=7)
        inside = charge.configure(connection=tx).enqueue(order=7)
        assert inside.duplicate and inside == first
        tx.rollback()
    after = charge.enqueue(order=7)
    assert not after.duplicate
    with psycopg.connect(dsn) as tx:
        answer = app.enqueue("charge", {"order": 7}, connection=tx)
        tx.commit()
    assert answer.duplicate and answer == after
    assert len(jobs_with(conn, "charge")) == 1


def test_a_running_unique_job_holds_its_key_until_a_real_worker_finishes_it(
    app: pgqueue.App, conn: Conn
) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    @app.task(unique=True)
    async def slow(n: int) -> None:
        started.set()
        await release.wait()

    @app.task(unique=True, unique_while="waiting")
    async def quick(n: int) -> None:
        started.set()
        await release.wait()

    async def scenario() -> None:
        first = await slow.enqueue_async(n=1)
        async with running_worker(app, concurrency=2, poll_interval=0.05):
            await asyncio.wait_for(started.wait(), 30)
            assert (await slow.enqueue_async(n=1)).duplicate  # 'active': held while running
            release.set()
            await wait_until_async(lambda: jobs_with(conn, "slow")[0][1] == "succeeded", timeout=30)
            again = await slow.enqueue_async(n=1)
            assert not again.duplicate and again != first
            await wait_until_async(
                lambda: all(r[1] == "succeeded" for r in jobs_with(conn, "slow")), timeout=30
            )
            release.clear()
            started.clear()
            waiting_rule = await quick.enqueue_async(n=1)
            await asyncio.wait_for(started.wait(), 30)
            # 'waiting': once it runs, a new one may wait beside it.
            assert not (await quick.enqueue_async(n=1)).duplicate
            assert waiting_rule is not None
            release.set()
        await app.aclose()

    asyncio.run(scenario())


def test_enqueue_many_honours_keys_within_the_batch_and_against_existing_jobs(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=["user"])
    def sync_user(user: int, n: int = 0) -> None: ...

    @app.task
    def plain(n: int) -> None: ...

    existing = sync_user.enqueue(user=0)
    batch: list[Any] = [("sync_user", {"user": i % 1500, "n": i}) for i in range(3000)]
    batch += [("plain", {"n": i}) for i in range(700)]
    batch += [{"task": "plain", "args": {"n": 1}, "unique_key": "once"}] * 3
    written = app.enqueue_many(batch)
    assert written == 1499 + 700 + 1  # user 0 existed; repeats in the batch are duplicates
    rows = jobs_with(conn, "sync_user")
    assert len(rows) == 1500 and rows[0][0] == existing
    assert {r[2]["user"] for r in rows} == set(range(1500))
    assert rows[1][2] == {"user": 1, "n": 1}  # 'keep': the first of the repeats
    assert len(jobs_with(conn, "plain")) == 701
    assert app.enqueue_many([("sync_user", {"user": 3})]) == 0


def test_enqueue_many_takes_over_keys_of_finished_jobs_in_the_callers_transaction(
    app: pgqueue.App, dsn: str, conn: Conn
) -> None:
    """The optimistic COPY meets keys of finished jobs: its savepoint rolls back, the keys are
    released and the jobs written again, and the caller's transaction goes on."""

    @app.task(unique=True)
    def ping(host: int) -> None: ...

    first = app.enqueue_many([("ping", {"host": h}) for h in range(1200)])
    assert first == 1200
    conn.execute("UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now()")
    with psycopg.connect(dsn) as tx:
        again = app.enqueue_many([("ping", {"host": h}) for h in range(1300)], connection=tx)
        tx.execute("CREATE TABLE after_the_batch (n int)")  # the transaction is still usable
        tx.commit()
    assert again == 1300
    waiting = conn.execute(
        "SELECT count(*) FROM pgqueue_jobs WHERE status = 'queued' AND unique_key IS NOT NULL"
    ).fetchone()
    assert waiting == (1300,)


def test_enqueue_many_replace_and_debounce_apply_repeats_in_turn(
    app: pgqueue.App, conn: Conn
) -> None:
    @app.task(unique=["doc"], on_conflict="debounce")
    def reindex(doc: int, version: int) -> None: ...

    reindex.enqueue(doc=1, version=0)
    written = app.enqueue_many(
        [("reindex", {"doc": d, "version": v}) for v in range(1, 4) for d in (1, 2)]
    )
    assert written == 1
    assert sorted((r[2]["doc"], r[2]["version"]) for r in jobs_with(conn, "reindex")) == [
        (1, 3),
        (2, 3),
    ]


async def test_enqueue_many_async_honours_keys(app: pgqueue.App, conn: Conn) -> None:
    @app.task(unique=True)
    async def ping(host: str) -> None: ...

    try:
        assert await app.enqueue_many_async([("ping", {"host": h}) for h in "abab"]) == 2
        assert await app.enqueue_many_async([("ping", {"host": h}) for h in "abc"]) == 1
    finally:
        await app.aclose()
    assert len(jobs_with(conn, "ping")) == 3


def test_a_bad_job_in_a_unique_batch_writes_nothing(app: pgqueue.App, conn: Conn) -> None:
    @app.task(unique=True)
    def ping(host: str) -> None: ...

    batch: list[Any] = [("ping", {"host": str(i)}) for i in range(1200)]
    batch.append(("ping", {"host": float("nan")}))
    with pytest.raises(InvalidJobError, match="job #1200"):
        app.enqueue_many(batch)
    assert jobs_with(conn, "ping") == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique": True, "unique_while": "running"}, "unique_while must be 'waiting'"),
        ({"unique": True, "unique_while": ["queued"]}, "or those states as a list"),
        (
            {"unique": True, "unique_while": ["queued", "succeeded"]},
            "after success with unique_for",
        ),
        ({"unique": True, "on_conflict": "merge"}, "on_conflict must be 'keep', 'replace'"),
        ({"unique": True, "unique_for": -1}, "unique_for must be a positive number"),
        ({"unique": True, "unique_for": float("inf")}, "unique_for must be a positive number"),
        ({"unique": "user"}, "unique must be True, a list of argument names"),
        ({"unique": ["not a name"]}, "is not an argument name"),
        ({"unique_while": "waiting"}, "not unique: pass unique=True"),
    ],
)
def test_a_bad_rule_is_refused_where_it_is_declared(
    app: pgqueue.App, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):

        @app.task(**options)
        def work(user: int) -> None: ...


def test_a_bad_key_is_refused_at_enqueue_and_writes_nothing(app: pgqueue.App, conn: Conn) -> None:
    @app.task(unique=lambda args: args["missing"])
    def keyed(user: int) -> None: ...

    @app.task
    def plain(user: int) -> None: ...

    with pytest.raises(InvalidJobError, match="unique key function of task 'keyed' failed"):
        keyed.enqueue(user=1)
    with pytest.raises(InvalidJobError, match="the limit is 1,000"):
        plain.configure(unique_key="k" * 1001).enqueue(user=1)
    with pytest.raises(InvalidJobError, match="NUL"):
        app.enqueue("plain", {"user": 1}, unique_key="a\x00b")
    with pytest.raises(InvalidJobError, match="contradict"):
        app.enqueue("plain", {"user": 1}, unique=False, unique_key="a")
    with pytest.raises(InvalidJobError, match=r"job #1: .*not unique"):
        app.enqueue_many([("plain", {"user": 1}), {"task": "plain", "on_conflict": "replace"}])
    assert jobs_with(conn, "keyed") == [] and jobs_with(conn, "plain") == []


# --- properties --------------------------------------------------------------------------------

operation = st.one_of(
    st.tuples(st.just("enqueue"), st.integers(0, 2)),
    st.tuples(st.just("move"), st.integers(0, 2), st.sampled_from(STATUSES)),
    st.tuples(st.just("age"), st.integers(0, 2)),
)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # each example starts empty
)
@given(
    rule=st.sampled_from(sorted(HOLDS)),
    operations=st.lists(operation, min_size=1, max_size=25),
)
def test_whatever_happens_to_jobs_one_key_has_at_most_one_holder_and_the_answer_follows_the_rule(
    dsn: str, rule: tuple[str, bool], operations: list[tuple[Any, ...]]
) -> None:
    """A model of the rule beside the database: each enqueue is answered as the model says, and
    the database never holds two jobs whose keys both hold."""
    unique_while, after_success = rule
    app = pgqueue.App(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pgqueue_jobs")

        @app.task(
            unique=True,
            unique_while=cast(Any, unique_while),
            unique_for=60 if after_success else None,
        )
        def work(k: int) -> None: ...

        holds = HOLDS[rule]
        # model: key -> list of (job id, status, aged) of its jobs
        jobs: dict[int, list[list[Any]]] = {0: [], 1: [], 2: []}
        try:
            for op in operations:
                if op[0] == "enqueue":
                    holder = [j for j in jobs[op[1]] if j[1] in holds and not j[2]]
                    answer = work.enqueue(k=op[1])
                    assert answer.duplicate == bool(holder)
                    if holder:
                        assert answer == holder[0][0]
                    else:
                        jobs[op[1]].append([int(answer), "queued", False])
                elif jobs[op[1]]:
                    job = jobs[op[1]][-1]
                    if op[0] == "move":
                        job[1], job[2] = op[2], False
                        set_status(conn, job[0], op[2])
                    elif job[1] == "succeeded":  # older than unique_for
                        job[2] = True
                        set_status(conn, job[0], "succeeded", finished_ago=120)
                for key, entries in jobs.items():
                    held = [j for j in entries if j[1] in holds and not j[2]]
                    assert len(held) <= 1, (key, entries)
        finally:
            app.close()


def _race(dsn: str, keys: int, barrier: Any, out: Any) -> None:
    app = pgqueue.App(dsn)

    @app.task(unique=True)
    def contended(k: int) -> None: ...

    answers = []
    barrier.wait()
    for k in range(keys):
        answer = contended.enqueue(k=k)
        answers.append((k, int(answer), answer.duplicate))
    app.close()
    out.put(answers)


@pytest.mark.slow
def test_eight_producer_processes_racing_on_the_same_keys_create_one_job_per_key(
    dsn: str, conn: Conn
) -> None:
    keys, producers = 200, 8
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(producers), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(dsn, keys, barrier, out)) for _ in range(producers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = conn.execute("SELECT args->>'k', id FROM pgqueue_jobs ORDER BY id").fetchall()
    assert len(rows) == keys  # one job per key, whoever won
    ids = {int(k): job_id for k, job_id in rows}
    for answers in results:
        for k, job_id, _ in answers:
            assert job_id == ids[k]  # every producer was told the one job's id
    new = [k for answers in results for k, _, duplicate in answers if not duplicate]
    assert sorted(new) == list(range(keys))  # and exactly one of them was told it was new
