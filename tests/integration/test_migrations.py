from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.migrate import applied_versions, available, migrate
from pgqueue.sql import queries
from tests.helpers import listening, notifications

Conn = psycopg.Connection[tuple[Any, ...]]

ALL_VERSIONS = [m.version for m in available()]


def _tables(conn: Conn, schema: str) -> set[str]:
    rows = conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
    ).fetchall()
    return {str(r[0]) for r in rows}


def test_migrate_applies_every_migration_on_an_empty_database_and_records_it(
    empty_dsn: str,
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert applied_versions(conn) == []
        assert migrate(conn) == ALL_VERSIONS
        assert {"pgqueue_jobs", "pgqueue_workers", "pgqueue_migrations"} <= _tables(conn, "public")
        rows = conn.execute("SELECT version, name FROM pgqueue_migrations ORDER BY 1").fetchall()
        assert rows == [(m.version, m.name) for m in available()]
        assert applied_versions(conn) == [m.version for m in available()]


def test_migrate_is_idempotent(empty_dsn: str) -> None:
    app = pgqueue.App(empty_dsn)
    assert app.migrate() == ALL_VERSIONS
    assert app.migrate() == []
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgqueue_migrations").fetchone() == (
            len(ALL_VERSIONS),
        )


def test_concurrent_migrations_apply_exactly_once(empty_dsn: str) -> None:
    barrier = threading.Barrier(4)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                barrier.wait(timeout=10)
                applied = migrate(conn)
            with lock:
                results.append(applied)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert sorted(results) == [[], [], [], ALL_VERSIONS]
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgqueue_migrations").fetchone() == (
            len(ALL_VERSIONS),
        )


def test_custom_schema_gets_its_own_tables_and_works_end_to_end(empty_dsn: str) -> None:
    app = pgqueue.App(empty_dsn, schema="jobs_x")
    try:
        assert app.migrate() == ALL_VERSIONS

        @app.task(queue="q1")
        def hello(name: str) -> None: ...

        job_id = hello.enqueue(name="world")
        assert app.enqueue_many([("hello", {"name": str(i)}) for i in range(5)]) == 5
        job = app.get_job(job_id)
        assert job is not None and job.args == {"name": "world"} and job.queue == "q1"
        assert app.status_counts() == [("q1", "queued", 6)]
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            assert {"pgqueue_jobs", "pgqueue_workers", "pgqueue_migrations"} <= _tables(
                conn, "jobs_x"
            )
            assert _tables(conn, "public") == set()
            assert conn.execute("SELECT count(*) FROM jobs_x.pgqueue_jobs").fetchone() == (6,)
            # the claim statement for the schema runs against its tables
            claimed = conn.execute(
                queries("jobs_x").claim_jobs,
                {"lease": 30, "worker_id": None, "limit": 2, "token": uuid.uuid4()},
            ).fetchall()
            assert len(claimed) == 2
    finally:
        app.close()


def test_claim_uses_the_partial_ready_index(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task, status, finished_at)"
        " SELECT 'q', 't', 'succeeded', now() FROM generate_series(1, 5000)"
    )
    conn.execute(
        "INSERT INTO pgqueue_jobs (queue, task) SELECT 'q', 't' FROM generate_series(1, 20)"
    )
    conn.execute("ANALYZE pgqueue_jobs")
    claim = queries("public").claim_jobs
    plan = conn.execute(
        b"EXPLAIN " + claim, {"lease": 30, "worker_id": None, "limit": 10, "token": uuid.uuid4()}
    ).fetchall()
    text = "\n".join(str(r[0]) for r in plan)
    assert "pgqueue_jobs_ready_idx" in text, text
    assert "Sort" not in text.split("LockRows")[-1], text  # index order, no sort of the queue


def test_lease_expiry_is_in_no_index(conn: Conn) -> None:
    rows = conn.execute(
        """
        SELECT i.indexrelid::regclass::text, a.attname
        FROM pg_index i
        JOIN pg_attribute a ON a.attrelid = i.indrelid
        WHERE i.indrelid = 'pgqueue_jobs'::regclass
          AND (a.attnum = ANY(i.indkey)
               OR pg_get_expr(i.indpred, i.indrelid) LIKE '%%' || a.attname || '%%'
               OR pg_get_expr(i.indexprs, i.indrelid) LIKE '%%' || a.attname || '%%')
        """
    ).fetchall()
    indexed = {str(r[1]) for r in rows}
    assert "lease_expires_at" not in indexed
    assert {"id", "priority", "run_at", "status"} <= indexed  # the query does see real indexes


@pytest.fixture
def listener(dsn: str) -> Any:
    """Says it waits for work: producers notify only while some worker waits (test_wakeups.py)."""
    with listening(dsn, waiting=True) as connection:
        yield connection


def test_bulk_insert_notifies_once_per_queue_without_arguments(
    app: pgqueue.App, listener: Conn
) -> None:
    jobs = [
        {"task": "t", "args": {"secret": f"value-{i}"}, "queue": "a" if i % 2 else "b"}
        for i in range(10_000)
    ]
    assert app.enqueue_many(jobs, allow_unknown=True) == 10_000
    got = notifications(listener, expected=2)
    assert sorted(got) == [("pgqueue", "a"), ("pgqueue", "b")]


def test_queue_names_longer_than_a_channel_name_still_notify(
    app: pgqueue.App, listener: Conn
) -> None:
    queue = "é" * 100  # 200 bytes in UTF-8; channel names stop at 63 bytes
    assert len(queue.encode()) == 200
    app.enqueue("t", {}, queue=queue, allow_unknown=True)
    assert notifications(listener, expected=1) == [("pgqueue", queue)]


def test_delayed_jobs_do_not_notify(app: pgqueue.App, listener: Conn) -> None:
    app.enqueue("t", {}, delay=60, allow_unknown=True)
    app.enqueue_many([{"task": "t", "delay": 60}], allow_unknown=True)
    assert notifications(listener) == []
    app.enqueue("t", {}, queue="now", allow_unknown=True)
    assert notifications(listener, expected=1) == [("pgqueue", "now")]


def test_custom_schema_notifies_on_its_own_channel(empty_dsn: str) -> None:
    app = pgqueue.App(empty_dsn, schema="jobs_y")
    try:
        app.migrate()
        with listening(empty_dsn, "jobs_y", waiting=True) as listener:
            app.enqueue("t", {}, queue="q", allow_unknown=True)
            assert notifications(listener, expected=1) == [("pgqueue_jobs_y", "q")]
    finally:
        app.close()
