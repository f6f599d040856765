"""Queues routed to independent clusters (``App(routes=...)``), on two real PostgreSQL clusters:
the test's usual server, and the session's second, throwaway cluster (``other_dsn``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.testing import bind, run_until_idle
from tests.conftest import Server
from tests.helpers import running_worker, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def routed(dsn: str, other_dsn: str) -> Iterator[pgqueue.App]:
    """Queue ``reports`` on the other cluster, every other queue on the test's database."""
    app = pgqueue.App(dsn, routes={"reports": other_dsn})
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def other(other_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(other_dsn, autocommit=True) as connection:
        yield connection


def jobs_on(conn: Conn) -> list[tuple[str, str]]:
    """(queue, task) of every job on a cluster, in id order."""
    rows = conn.execute("SELECT queue, task FROM pgqueue_jobs ORDER BY id").fetchall()
    return [(str(q), str(t)) for q, t in rows]


def test_clusters_are_two_servers(dsn: str, other_dsn: str) -> None:
    ports = set()
    for target in (dsn, other_dsn):
        with psycopg.connect(target) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
            assert row is not None
            ports.add((conn.info.port, row[0]))
    assert len(ports) == 2


async def test_every_enqueue_path_writes_to_the_cluster_of_its_queue(
    dsn: str, other_dsn: str, conn: Conn, other: Conn
) -> None:
    app = pgqueue.App(dsn, routes={"reports": other_dsn})

    @app.task(queue="reports")
    def report(n: int) -> int:
        return n

    @app.task
    def mail(n: int) -> int:
        return n

    try:
        report.enqueue(n=1)
        await report.enqueue_async(n=2)
        mail.configure(queue="reports").enqueue(n=3)
        report.configure(queue="anything").enqueue(n=4)  # an unrouted queue: the default cluster
        mail.enqueue(n=5)
        written = app.enqueue_many(
            [("report", {"n": 6}), ("mail", {"n": 7}), {"task": "mail", "args": {"n": 8},
             "queue": "reports"}]
        )  # fmt: skip
        assert written == 3
        assert await app.enqueue_many_async([("report", {"n": 9}), ("mail", {"n": 10})]) == 2
    finally:
        app.close()
    assert jobs_on(other) == [("reports", "report")] * 2 + [("reports", "mail")] + [
        ("reports", "report"), ("reports", "mail"), ("reports", "report")
    ]  # fmt: skip
    assert jobs_on(conn) == [("anything", "report"), ("default", "mail"), ("default", "mail"),
                             ("default", "mail")]  # fmt: skip


async def test_the_coalescing_producer_writes_to_the_cluster_of_its_queue(
    dsn: str, other_dsn: str, conn: Conn, other: Conn
) -> None:
    app = pgqueue.App(dsn, routes={"reports": other_dsn}, coalesce=True)
    try:
        await asyncio.gather(
            *(app.enqueue_async("t", {"i": i}, queue="reports", allow_unknown=True)
              for i in range(20)),
            *(app.enqueue_async("t", {"i": i}, allow_unknown=True) for i in range(10)),
        )  # fmt: skip
        app.enqueue("t", {}, queue="reports", allow_unknown=True)
        stats = app.cluster("reports").coalesce_stats
        assert stats is not None and stats.jobs == 21
    finally:
        app.close()
    assert len(jobs_on(other)) == 21 and {q for q, _ in jobs_on(other)} == {"reports"}
    assert len(jobs_on(conn)) == 10 and {q for q, _ in jobs_on(conn)} == {"default"}


def test_each_clusters_worker_runs_its_own_jobs_and_lookups_find_them(
    routed: pgqueue.App, conn: Conn, other: Conn
) -> None:
    @routed.task(queue="reports")
    def report(n: int) -> str:
        return f"report {n}"

    @routed.task
    def mail(n: int) -> str:
        return f"mail {n}"

    r = report.enqueue(n=1)
    m = mail.enqueue(n=1)
    # Both clusters number their jobs from 1: the same id, two different jobs.
    assert int(r) == int(m) == 1 and (r.queue, m.queue) == ("reports", "default")

    runs = run_until_idle(routed, ["reports"])  # the worker of the reports queue's cluster
    assert [(run.task, run.result) for run in runs] == [("report", "report 1")]
    assert routed.get_job(m).status is pgqueue.Status.QUEUED  # type: ignore[union-attr]
    runs = run_until_idle(routed)  # the default cluster's worker, every queue there
    assert [(run.task, run.result) for run in runs] == [("mail", "mail 1")]

    assert routed.wait(r, timeout=5) == "report 1"
    assert routed.wait(m, timeout=5) == "mail 1"
    assert routed.wait(1, timeout=5, queue="reports") == "report 1"
    assert routed.wait(1, timeout=5, queue="default") == "mail 1"
    found = routed.get_job(1, queue="reports")
    assert found is not None and (found.task, found.result) == ("report", "report 1")
    assert [a.outcome for a in routed.job_attempts(r)] == ["succeeded"]
    assert routed.cluster("reports").get_job(1).task == "report"  # type: ignore[union-attr]


async def test_waiting_for_a_routed_job_is_woken_on_its_cluster(routed: pgqueue.App) -> None:
    @routed.task(queue="reports")
    async def report() -> str:
        return "done"

    job = await report.enqueue_async()
    async with running_worker(routed, queues=["reports"]):
        assert await routed.wait_async(job, timeout=30) == "done"


def test_a_plain_id_on_an_app_with_routes_needs_its_queue(
    routed: pgqueue.App, conn: Conn, other: Conn
) -> None:
    on_default = routed.enqueue("t", allow_unknown=True)
    on_reports = routed.enqueue("t", queue="reports", allow_unknown=True)
    assert int(on_default) == int(on_reports) == 1
    for call in (routed.get_job, routed.cancel, routed.requeue, routed.job_attempts,
                 routed.retry_now, lambda i: routed.wait(i, timeout=0)):  # fmt: skip
        with pytest.raises(pgqueue.InvalidJobError, match="pass queue="):
            call(1)
    # The id names the job on its queue's cluster only: the other job 1 is untouched.
    assert routed.cancel(1, queue="reports") is pgqueue.CancelResult.CANCELLED
    assert other.execute("SELECT status::text FROM pgqueue_jobs").fetchall() == [("cancelled",)]
    assert conn.execute("SELECT status::text FROM pgqueue_jobs").fetchall() == [("queued",)]
    assert routed.requeue(on_reports)
    assert other.execute("SELECT status::text FROM pgqueue_jobs").fetchall() == [("queued",)]


def test_workflows_across_clusters_are_refused_and_write_nothing(
    routed: pgqueue.App, conn: Conn, other: Conn
) -> None:
    @routed.task(queue="reports")
    def report(results: list[Any] | None = None) -> None: ...

    @routed.task
    def mail(results: list[Any] | None = None) -> None: ...

    parent = mail.enqueue()
    with pytest.raises(pgqueue.InvalidJobError, match="parents and children must be on one"):
        report.configure(after=[parent]).enqueue()
    with pytest.raises(pgqueue.InvalidJobError, match="parents and children must be on one"):
        routed.enqueue("report", after=[parent])
    with pytest.raises(pgqueue.InvalidJobError, match="spans clusters"):
        routed.chain(mail.s(), report.s())
    with pytest.raises(pgqueue.InvalidJobError, match="spans clusters"):
        routed.group([mail.s(), mail.s()], then=report.s())
    assert jobs_on(conn) == [("default", "mail")] and jobs_on(other) == []

    # Within one cluster, workflows work as on a single database, ids and all.
    first = report.enqueue()
    child = report.configure(after=[first]).enqueue()
    steps = routed.chain(report.s(), report.s())
    done = routed.group([report.s(), report.s()], then=report.s())
    assert done.callback is not None and done.callback.queue == "reports"
    assert [s.queue for s in steps] == ["reports", "reports"]
    assert len(jobs_on(other)) == 7
    runs = run_until_idle(routed, ["reports"])
    assert len(runs) == 7 and all(run.succeeded for run in runs)
    assert routed.get_job(child).status is pgqueue.Status.SUCCEEDED  # type: ignore[union-attr]


def test_a_caller_transaction_enqueue_into_another_clusters_queue_is_refused(
    routed: pgqueue.App, dsn: str, other_dsn: str, conn: Conn, other: Conn
) -> None:
    with psycopg.connect(dsn) as caller:
        with pytest.raises(pgqueue.InvalidJobError, match="could not commit with your trans"):
            routed.enqueue("t", queue="reports", connection=caller, allow_unknown=True)
        with pytest.raises(pgqueue.InvalidJobError, match="could not commit with your trans"):
            routed.enqueue_many([("t", {}), {"task": "t", "queue": "reports"}],
                                connection=caller, allow_unknown=True)  # fmt: skip
        routed.enqueue("t", connection=caller, allow_unknown=True)
        caller.commit()
    assert jobs_on(conn) == [("default", "t")] and jobs_on(other) == []
    # On a connection to the routed cluster, through that cluster's app: it commits with it.
    with psycopg.connect(other_dsn) as caller:
        routed.cluster("reports").enqueue("t", queue="reports", connection=caller,
                                          allow_unknown=True)  # fmt: skip
        caller.commit()
    assert jobs_on(other) == [("reports", "t")]


def test_a_worker_serves_one_cluster(routed: pgqueue.App) -> None:
    with pytest.raises(pgqueue.ConfigurationError, match="run one worker per cluster"):
        routed.worker(queues=["default", "reports"])
    assert routed.worker(queues=["reports"]).app is routed.cluster("reports")
    assert routed.worker(queues=["default", "mail"]).app is routed
    assert routed.worker().app is routed


async def test_schedules_live_and_fire_on_the_cluster_of_their_queue(
    routed: pgqueue.App, conn: Conn, other: Conn
) -> None:
    @routed.periodic(cron="* * * * * *")
    @routed.task(queue="reports")
    def tick() -> None: ...

    @routed.periodic(cron="@daily")
    @routed.task
    def nightly() -> None: ...

    def schedules(c: Conn) -> list[str]:
        return [str(r[0]) for r in c.execute("SELECT name FROM pgqueue_schedules ORDER BY 1")]

    async with running_worker(routed) as on_default, running_worker(
        routed, queues=["reports"], poll_interval=0.2
    ):  # fmt: skip
        await wait_until_async(lambda: on_default.scheduler.synced, timeout=30)
        await wait_until_async(lambda: jobs_on(other), timeout=30)
    assert schedules(conn) == ["nightly"] and schedules(other) == ["tick"]
    assert {q for q, _ in jobs_on(other)} == {"reports"}
    assert jobs_on(conn) == []


def test_migrate_migrates_every_cluster(pg_server: Server, other_server: Server) -> None:
    with pg_server.database(migrated=False) as a, other_server.database(migrated=False) as b:
        app = pgqueue.App(a, routes={"reports": b, "exports": b})
        try:
            assert app.migrate()  # every version, on both
            assert app.migrate() == []
        finally:
            app.close()
        for target in (a, b):
            with psycopg.connect(target) as c:
                assert c.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


def test_operations_that_name_a_queue_act_on_its_cluster(
    routed: pgqueue.App, conn: Conn, other: Conn
) -> None:
    routed.enqueue("t", queue="reports", allow_unknown=True)
    assert routed.pause_queue("reports")
    assert routed.paused_queues() == []
    assert routed.cluster("reports").paused_queues() == ["reports"]
    assert [j.queue for j in routed.find_jobs(queue="reports")] == ["reports"]
    assert routed.find_jobs() == []
    assert routed.cancel_jobs(queue="reports") == 1


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ("postgresql://x", "routes must map queue names to DSNs"),
        ({"a,b": "postgresql://x"}, "must not contain a comma"),
        ({"reports": ""}, "needs a DSN string"),
        ({"reports": "nonsense"}, "routes: queue 'reports': invalid DSN"),
    ],
)
def test_bad_routes_are_refused_at_declaration(routes: Any, message: str) -> None:
    with pytest.raises(pgqueue.ConfigurationError, match=message):
        pgqueue.App("postgresql://localhost/x", routes=routes)


def test_a_routed_app_bound_to_a_test_database_keeps_every_queue_there(
    dsn: str, conn: Conn, other: Conn
) -> None:
    app = pgqueue.App("postgresql://production/app", routes={"reports": "postgresql://r/app"})

    @app.task(queue="reports")
    def report() -> None: ...

    with bind(app, dsn):
        report.enqueue()
        report.configure(queue="default").enqueue()
        assert app.cluster("reports") is app
        assert len(run_until_idle(app, ["reports"])) == 1
    assert jobs_on(conn) == [("reports", "report"), ("default", "report")]
    assert jobs_on(other) == []
    assert app.routes == {"reports": "postgresql://r/app"}
