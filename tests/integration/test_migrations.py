from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

import pgqueue
from pgqueue.errors import ConfigurationError
from pgqueue.migrate import Migration, MigrationError, applied_versions, available, migrate
from pgqueue.sql import queries
from tests.helpers import listening, notifications, register_worker, wait_until
from tests.upgrade import TEST_VERSIONS, UPGRADE, Migrator, backend_waiting, index_state, upgraded

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
            worker = uuid.uuid4()
            register_worker(conn, worker, schema="jobs_x")
            claimed = conn.execute(
                queries("jobs_x").claim_jobs,
                {"worker_id": worker, "limit": 2, "token": uuid.uuid4(), "tasks": None},
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
        b"EXPLAIN " + claim,
        {"worker_id": uuid.uuid4(), "limit": 10, "token": uuid.uuid4(), "tasks": None},
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


def test_delayed_jobs_notify_too(app: pgqueue.App, listener: Conn) -> None:
    """A waiting worker sleeps until the earliest run_at it knows of: it must hear of jobs
    enqueued to run later as well (migration 0005)."""
    app.enqueue("t", {}, queue="later", delay=60, allow_unknown=True)
    app.enqueue_many([{"task": "t", "queue": "bulk-later", "delay": 60}], allow_unknown=True)
    assert notifications(listener, expected=2) == [("pgqueue", "later"), ("pgqueue", "bulk-later")]
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


# --- upgrading a live database (tests/upgrade: a column, then an index built concurrently) ------


def _advisory_locks(conn: Conn, pid: int) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_timeout_error_names_the_session_in_the_way_and_the_run_resumes_after(
    dsn: str, conn: Conn
) -> None:
    blocker = psycopg.connect(dsn, application_name="nightly-report")
    blocker.execute("SELECT count(*) AS nightly_report FROM pgqueue_jobs")
    with psycopg.connect(dsn, autocommit=True) as migrating:
        migrating.execute("SET lock_timeout = '7s'")
        started = time.monotonic()
        with pytest.raises(MigrationError) as failure:
            migrate(migrating, migrations=UPGRADE, lock_timeout=0.2, timeout=2)
        took = time.monotonic() - started
        message = str(failure.value)
        assert message.startswith(
            "migration 9001_probe_column could not take its locks within the 2 s timeout"
        ), message
        assert (
            f"pid {blocker.info.backend_pid} (idle in transaction, transaction open for " in message
        )
        assert "application 'nightly-report': SELECT count(*) AS nightly_report FROM" in message
        assert 1 < took < 2 + 0.2 + 3  # about the timeout, whatever the machine's load
        # the connection is handed back as it came, and the migration lock is free
        assert migrating.execute("SHOW lock_timeout").fetchone() == ("7s",)
        assert _advisory_locks(conn, migrating.info.backend_pid) == 0
    blocker.rollback()
    blocker.close()
    assert applied_versions(conn) == ALL_VERSIONS
    assert migrate(conn, migrations=UPGRADE) == TEST_VERSIONS
    assert upgraded(conn)


def test_each_migration_is_all_or_nothing_and_a_failure_is_one_clear_error(
    dsn: str, conn: Conn
) -> None:
    broken = Migration(
        9001,
        "broken",
        "ALTER TABLE {schema}.pgqueue_jobs ADD COLUMN half_done text;\nSELECT no_such_function();",
    )
    with pytest.raises(MigrationError) as failure:
        migrate(conn, migrations=[*available(), broken])
    assert str(failure.value) == (
        "migration 9001_broken failed: function no_such_function() does not exist"
    )
    assert applied_versions(conn) == ALL_VERSIONS
    columns = conn.execute(
        "SELECT 1 FROM information_schema.columns WHERE column_name = 'half_done'"
    ).fetchall()
    assert columns == []
    assert _advisory_locks(conn, conn.info.backend_pid) == 0


def test_an_interrupted_concurrent_index_build_is_dropped_and_built_again(
    dsn: str, conn: Conn
) -> None:
    assert migrate(conn, migrations=[m for m in UPGRADE if m.version < 9002]) == [9001]
    # A transaction that wrote to the table: a concurrent build waits for it to end.
    writer = psycopg.connect(dsn)
    writer.execute("INSERT INTO pgqueue_jobs (queue, task) VALUES ('q', 't')")
    migrator = Migrator(dsn, UPGRADE, lock_timeout=0.2, timeout=120)
    migrator.start()
    pid = wait_until(lambda: backend_waiting(conn, "migrator", "virtualxid"), timeout=30)
    assert index_state(conn) == (False, False)  # the catalog entry is committed, not built
    # the run is killed (a deploy step cancelled, a node lost)
    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    migrator.join(30)
    assert isinstance(migrator.error, psycopg.OperationalError)
    writer.rollback()
    writer.close()
    assert index_state(conn) == (False, False)  # what IF NOT EXISTS alone would keep
    assert applied_versions(conn) == [*ALL_VERSIONS, 9001]

    assert migrate(conn, migrations=UPGRADE) == [9002]
    assert upgraded(conn)
    names = conn.execute(
        "SELECT indexname FROM pg_indexes WHERE indexname LIKE 'pgqueue_jobs_upgrade%%'"
    ).fetchall()
    assert names == [("pgqueue_jobs_upgrade_probe_idx",)]


def _waits_for_the_migration_lock(conn: Conn, application: str) -> bool:
    """The session has asked for the migration lock (and been refused) without holding it."""
    row = conn.execute(
        "SELECT a.query LIKE '%%pg_try_advisory_lock%%', count(l.pid)"
        " FROM pg_stat_activity a"
        " LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory'"
        " WHERE a.application_name = %s GROUP BY a.query",
        (application,),
    ).fetchone()
    return row == (True, 0)


def test_a_second_migrator_waits_for_the_first_and_finds_nothing_left(dsn: str, conn: Conn) -> None:
    blocker = psycopg.connect(dsn)
    blocker.execute("SELECT count(*) FROM pgqueue_jobs")
    first = Migrator(dsn, UPGRADE, "migrator-1", lock_timeout=0.2, timeout=120)
    second = Migrator(dsn, UPGRADE, "migrator-2", lock_timeout=0.2, timeout=120)
    try:
        first.start()
        wait_until(lambda: backend_waiting(conn, "migrator-1", "relation"))
        second.start()
        wait_until(lambda: _waits_for_the_migration_lock(conn, "migrator-2"))
    finally:
        blocker.rollback()
        blocker.close()
    assert first.finish() == TEST_VERSIONS
    assert second.finish() == []
    assert applied_versions(conn) == [*ALL_VERSIONS, *TEST_VERSIONS]


@pytest.mark.parametrize("schema", ["public", "jobs_y"])  # keys of either sign
def test_a_migrator_kept_waiting_by_another_names_it(empty_dsn: str, schema: str) -> None:
    with (
        psycopg.connect(empty_dsn, autocommit=True, application_name="other-migrator") as other,
        psycopg.connect(empty_dsn, autocommit=True) as conn,
    ):
        other.execute(
            "SELECT pg_advisory_lock(hashtextextended('pgqueue.migrate:' || %s, 0))", (schema,)
        )
        with pytest.raises(MigrationError) as failure:
            migrate(conn, schema, timeout=0.5)
        message = str(failure.value)
        assert message.startswith(
            f"another migration of schema {schema!r} held the migration lock for all of 0.5 s"
        ), message
        assert f"held by pid {other.info.backend_pid} (idle, connected for " in message
        assert "application 'other-migrator'" in message
        assert applied_versions(conn, schema) == []
        other.execute(
            "SELECT pg_advisory_unlock(hashtextextended('pgqueue.migrate:' || %s, 0))", (schema,)
        )
        assert migrate(conn, schema) == ALL_VERSIONS


def test_migrate_hands_a_connection_back_as_it_came(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:  # not autocommit
        assert migrate(conn) == ALL_VERSIONS
        assert conn.autocommit is False
        assert _status(conn) == psycopg.pq.TransactionStatus.IDLE
        conn.execute("SELECT 1")  # now inside a transaction: migrating would commit it
        with pytest.raises(ConfigurationError, match="not inside a transaction"):
            migrate(conn)
        assert _status(conn) == psycopg.pq.TransactionStatus.INTRANS


def _status(conn: Conn) -> psycopg.pq.TransactionStatus:
    return conn.info.transaction_status


@pytest.mark.parametrize(
    ("option", "value"),
    [("lock_timeout", 0), ("lock_timeout", -1), ("timeout", float("nan")), ("timeout", True)],
)
def test_timeouts_must_be_positive_numbers_of_seconds(
    conn: Conn, option: str, value: float
) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ConfigurationError, match=f"{option} must be a positive number of seconds"):
        migrate(conn, **options)


def test_two_migrations_with_one_number_are_refused(conn: Conn) -> None:
    with pytest.raises(MigrationError, match="two migrations are numbered 0004"):
        migrate(conn, migrations=[*available(), Migration(4, "again", "SELECT 1;")])
