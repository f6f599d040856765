"""The producer's connections: bounded across event loops, closed when their loop ends, checked
before use, and every outage a prompt DatabaseUnavailableError that the App recovers from."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

import pgqueue
from pgqueue import DatabaseUnavailableError, pools
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.migrate import migrate
from tests.helpers import ROOT, wait_until

Conn = psycopg.Connection[tuple[Any, ...]]

# The other client sessions of the test's database: each test has a database of its own (an
# autovacuum worker visiting it is not one).
SESSIONS = (
    "SELECT {} FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend'"
)
COUNT = SESSIONS.format("count(*)")
TERMINATE = SESSIONS.format("pg_terminate_backend(pid)")
NAMES = SESSIONS.format("application_name")
TERMINATE_LOCK_WAITERS = TERMINATE + " AND wait_event_type = 'Lock'"


def connections(conn: Conn) -> int:
    """Server connections to the test's database, other than ``conn``."""
    row = conn.execute(COUNT).fetchone()
    assert row is not None
    return int(row[0])


def terminate_others(conn: Conn) -> int:
    """pg_terminate_backend every other session of the database, and wait until they are gone
    (each has then sent its client the goodbye and closed the socket)."""
    rows = conn.execute(TERMINATE).fetchall()
    wait_until(lambda: connections(conn) == 0, what="terminated sessions gone")
    return len(rows)


def loops(dsn: str, loop: str, mode: str, count: int) -> dict[str, Any]:
    """tests/producer_loops.py in a subprocess; a hang is a timeout that fails the test."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tests.producer_loops", dsn, loop, mode, str(count)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{count} event loops did not finish within 120 s: {exc}") from None
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# --- one pool per event loop, closed with it ----------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_repeated_asyncio_run_keeps_connections_bounded_and_closes_them(
    dsn: str, loop: str
) -> None:
    result = loops(dsn, loop, "enqueue", 25)
    assert max(result["during"]) <= pools.MAX_SIZE
    assert result["after"] == [0] * 25  # each loop's connections closed when it ended
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (25 * 8,)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_loops_whose_first_enqueue_fails_end_without_hanging_or_leaking(
    empty_dsn: str, loop: str
) -> None:
    """No pgqueue tables: each loop's first enqueue fails after connecting."""
    result = loops(empty_dsn, loop, "failing", 25)
    assert result["errors"] == ["UndefinedTable"]
    assert max(result["during"]) <= 1
    assert result["after"] == [0] * 25


def test_loops_whose_server_refuses_connections_end_promptly(dsn: str) -> None:
    started = time.monotonic()
    result = loops(dsn, "asyncio", "refused", 20)
    assert result["errors"] == ["DatabaseUnavailableError"]
    assert time.monotonic() - started < 60


def test_a_loop_closed_without_asyncio_run_is_cleaned_up_by_the_next_loop(
    app: pgqueue.App, conn: Conn
) -> None:
    loop = asyncio.new_event_loop()
    loop.run_until_complete(app.enqueue_async("t", {}, allow_unknown=True))
    loop.close()  # no shutdown_asyncgens(): pgqueue is not told
    assert connections(conn) == 1

    async def produce() -> int:
        await app.enqueue_async("t", {}, allow_unknown=True)
        return connections(conn)

    assert asyncio.run(produce()) == 1  # the closed loop's connection is gone, ours is open
    wait_until(lambda: connections(conn) == 0, what="the second loop's connection closed")


def test_close_closes_sync_and_every_loops_connections_and_the_app_stays_usable(
    app: pgqueue.App, conn: Conn
) -> None:
    app.enqueue("t", {}, allow_unknown=True)
    with asyncio.Runner() as runner:  # a loop that stays open, as a web server's does
        runner.run(app.enqueue_async("t", {}, allow_unknown=True))
        assert connections(conn) == 2
        app.close()
        wait_until(lambda: connections(conn) == 0, what="every producer connection closed")
        runner.run(app.enqueue_async("t", {}, allow_unknown=True))
        app.enqueue("t", {}, allow_unknown=True)
        assert connections(conn) == 2
        runner.run(app.aclose())
        wait_until(lambda: connections(conn) == 0, what="closed again by aclose()")
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (4,)


async def test_async_with_app_closes_its_connections_when_the_block_ends(
    dsn: str, conn: Conn
) -> None:
    async with pgqueue.App(dsn) as app:
        await app.enqueue_async("t", {}, allow_unknown=True)
        assert connections(conn) == 1
    wait_until(lambda: connections(conn) == 0, what="the lifespan's connections closed")
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (1,)


def test_with_app_closes_its_connections_when_the_block_ends(dsn: str, conn: Conn) -> None:
    with pgqueue.App(dsn) as app:
        app.enqueue("t", {}, allow_unknown=True)
        assert connections(conn) == 1
    wait_until(lambda: connections(conn) == 0, what="the block's connections closed")


async def test_entering_an_app_without_a_dsn_fails_at_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(pgqueue.ConfigurationError, match="no database configured"):
        async with pgqueue.App():
            pass
    with pytest.raises(pgqueue.ConfigurationError, match="no database configured"), pgqueue.App():
        pass


def test_producer_connections_are_named_unless_the_dsn_names_them(dsn: str, conn: Conn) -> None:
    app = pgqueue.App(conninfo.make_conninfo(dsn, application_name="shop-web"))
    try:
        app.enqueue("t", {}, allow_unknown=True)
        pgqueue.App(dsn).enqueue("t", {}, allow_unknown=True)
        names = conn.execute(NAMES).fetchall()
    finally:
        app.close()
    assert ("shop-web",) in names
    kwargs = pools.connect_kwargs(dsn, {})
    assert kwargs["application_name"] == pools.APPLICATION_NAME
    assert kwargs["connect_timeout"] == 10 and kwargs["tcp_user_timeout"] == 15000
    assert "connect_timeout" not in pools.connect_kwargs(
        conninfo.make_conninfo(dsn, connect_timeout=3), {}
    )


# --- pooled connections killed while idle ------------------------------------------------------


def test_every_sync_entry_point_survives_terminated_pooled_connections(
    app: pgqueue.App, conn: Conn
) -> None:
    calls: dict[str, Callable[[], object]] = {
        "enqueue": lambda: app.enqueue("t", {}, allow_unknown=True),
        "enqueue_many": lambda: app.enqueue_many([("t", {})], allow_unknown=True),
        "get_job": lambda: app.get_job(1),
        "requeue": lambda: app.requeue(1),
        "cancel": lambda: app.cancel(1),
        "status_counts": app.status_counts,
        "connection": lambda: _select_one(app),
    }
    for name, call in calls.items():
        with app.connection() as a, app.connection() as b:  # two pooled connections
            assert a is not b
        # Both, and any the pool opened meanwhile to replace the last round's (on a loaded
        # machine a third was still being opened: 3 killed, not 2).
        assert terminate_others(conn) >= 2, name
        call()  # neither AdminShutdown nor a failure on the dead connection
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (2,)


def _select_one(app: pgqueue.App) -> None:
    with app.connection() as c:
        assert c.execute("SELECT 1").fetchone() == (1,)


def test_async_entry_points_survive_terminated_pooled_connections(
    app: pgqueue.App, conn: Conn
) -> None:
    async def produce() -> None:
        await asyncio.gather(*(app.enqueue_async("t", {}, allow_unknown=True) for _ in range(3)))
        assert terminate_others(conn) >= 2
        await app.enqueue_async("t", {}, allow_unknown=True)
        assert terminate_others(conn) == 1
        await app.enqueue_many_async([("t", {})], allow_unknown=True)

    asyncio.run(produce())
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (5,)


def test_a_write_whose_connection_dies_mid_statement_is_not_retried(
    app: pgqueue.App, conn: Conn
) -> None:
    """The INSERT was sent: whether it ran is unknown, so it is never sent again."""
    app.enqueue("t", {}, allow_unknown=True)
    failure: list[BaseException] = []

    def enqueue() -> None:
        try:
            app.enqueue("t", {}, allow_unknown=True)
        except BaseException as exc:
            failure.append(exc)

    with conn.transaction():
        conn.execute("LOCK TABLE pgqueue_jobs IN ACCESS EXCLUSIVE MODE")
        thread = threading.Thread(target=enqueue)
        thread.start()
        wait_until(
            lambda: conn.execute(TERMINATE_LOCK_WAITERS).fetchall(),
            what="the enqueue waiting on the lock",
        )
        # A retry would wait on the lock again: returning while it is held shows there is none.
        thread.join(10)
        assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], DatabaseUnavailableError)
    assert str(failure[0]).startswith("lost the connection to PostgreSQL at ")
    assert str(failure[0]).endswith("the write may or may not have been applied")
    assert failure[0].uncertain
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (1,)


# --- a read-only server (a standby not promoted yet) ------------------------------------------


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[object]:
    """Calls of ``pools.<name>`` (a failure the pool retries) from now on."""
    calls: list[object] = []
    original = getattr(pools, name)

    def counting(*args: Any) -> Any:
        result = original(*args)
        calls.append(result)
        return result

    monkeypatch.setattr(pools, name, counting)
    return calls


def _set_read_only(conn: Conn, on: bool) -> None:
    """Every new session of the test's database read-only (as on a standby), or not."""
    database = sql.Identifier(str(conn.info.dbname))
    if on:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database)
        )
    else:
        conn.execute(
            sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database)
        )


@pytest.mark.parametrize("flavour", ["sync", "async", "coalesce"])
def test_a_write_refused_as_read_only_is_retried_until_the_server_takes_it(
    dsn: str, conn: Conn, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """25006 proves nothing was written: the call waits (as during a promotion) and the job is
    written once the server accepts writes, exactly once."""
    refusals = _counted(monkeypatch, "standby_refused")
    app = pgqueue.App(dsn, reconnect_timeout=60, coalesce=flavour == "coalesce")
    _set_read_only(conn, True)
    outcome: list[object] = []

    def enqueue() -> None:
        try:
            if flavour == "sync":
                outcome.append(app.enqueue("t", {"n": 1}, allow_unknown=True))
            else:
                outcome.append(asyncio.run(app.enqueue_async("t", {"n": 1}, allow_unknown=True)))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=enqueue)
    try:
        thread.start()
        wait_until(lambda: len(refusals) >= 3 or outcome, what="refused tries")
        assert not outcome, outcome
        _set_read_only(conn, False)
        thread.join(60)
        assert not thread.is_alive()
    finally:
        _set_read_only(conn, False)
        app.close()
    assert len(outcome) == 1 and isinstance(outcome[0], int), outcome
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (1,)


def test_a_server_that_stays_read_only_is_a_clear_error_once_the_budget_is_spent(
    dsn: str, conn: Conn
) -> None:
    app = pgqueue.App(dsn, reconnect_timeout=0.5)
    _set_read_only(conn, True)
    try:
        with pytest.raises(DatabaseUnavailableError) as info:
            app.enqueue("t", {}, allow_unknown=True)
    finally:
        _set_read_only(conn, False)
        app.close()
    message = str(info.value)
    assert "is read-only (a standby)" in message and "\n" not in message
    assert message.endswith("(retried for 0.5 s); nothing was written")
    assert not info.value.uncertain
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


# --- a server that goes down and comes back -----------------------------------------------------


@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedPostgres]:
    """A cluster of this module's own, which the tests stop and start."""
    cluster = EmbeddedPostgres().start()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            migrate(conn, "public")
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_server_outage_is_a_prompt_clear_error_and_the_app_recovers(
    own_server: EmbeddedPostgres, mode: str
) -> None:
    app = pgqueue.App(own_server.dsn, reconnect_timeout=0)
    runner = asyncio.Runner()
    try:
        job = app.enqueue("t", {}, allow_unknown=True)
        runner.run(app.enqueue_async("t", {}, allow_unknown=True))  # both pools hold one
        own_server.stop_server(mode)
        calls: dict[str, Callable[[], object]] = {
            "enqueue": lambda: app.enqueue("t", {}, allow_unknown=True),
            "enqueue_many": lambda: app.enqueue_many([("t", {})], allow_unknown=True),
            "get_job": lambda: app.get_job(job),
            "requeue": lambda: app.requeue(job),
            "cancel": lambda: app.cancel(job),
            "status_counts": app.status_counts,
            "connection": lambda: _select_one(app),
            "enqueue_async": lambda: runner.run(app.enqueue_async("t", {}, allow_unknown=True)),
            "enqueue_many_async": lambda: runner.run(
                app.enqueue_many_async([("t", {})], allow_unknown=True)
            ),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailableError) as info:
                call()
            assert time.monotonic() - started < 5, name  # not a 10 s pool timeout
            message = str(info.value)
            assert "\n" not in message
            assert message.startswith(
                f"cannot connect to PostgreSQL at 127.0.0.1:{own_server.port}/"
            )
        own_server.start_server()
        # The first call after the outage already works, on a fresh connection.
        assert runner.run(app.enqueue_async("t", {}, allow_unknown=True)) > job
        assert app.enqueue("t", {}, allow_unknown=True) > job
        assert app.get_job(job) is not None
    finally:
        runner.close()
        app.close()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_call_made_while_the_server_is_down_waits_for_it_and_writes_once(
    own_server: EmbeddedPostgres, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connection refused proves nothing was sent: the call retries with backoff until the
    server is back (within reconnect_timeout), and its job is written exactly once."""
    refused = _counted(monkeypatch, "unreachable")
    app = pgqueue.App(own_server.dsn, reconnect_timeout=120)
    outcome: list[object] = []

    def enqueue() -> None:
        try:
            if flavour == "sync":
                outcome.append(app.enqueue("t", {"down": flavour}, allow_unknown=True))
            else:
                outcome.append(
                    asyncio.run(app.enqueue_async("t", {"down": flavour}, allow_unknown=True))
                )
        except BaseException as exc:
            outcome.append(exc)

    own_server.stop_server("immediate")
    thread = threading.Thread(target=enqueue)
    try:
        thread.start()
        wait_until(lambda: len(refused) >= 3 or outcome, what="refused connects")
        assert not outcome, outcome
    finally:
        own_server.start_server()
    thread.join(120)
    app.close()
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], int), outcome
    with psycopg.connect(own_server.dsn) as check:
        rows = check.execute(
            "SELECT count(*) FROM pgqueue_jobs WHERE args->>'down' = %s", (flavour,)
        ).fetchone()
    assert rows == (1,)


def test_retries_end_with_a_clear_error_and_bad_settings_are_not_retried(
    own_server: EmbeddedPostgres,
) -> None:
    down = pgqueue.App("postgresql://postgres@127.0.0.1:1/x", reconnect_timeout=0.5)
    with pytest.raises(DatabaseUnavailableError) as info:
        down.enqueue("t", {}, allow_unknown=True)
    assert str(info.value).startswith("cannot connect to PostgreSQL at 127.0.0.1:1/x: ")
    assert str(info.value).endswith("(retried for 0.5 s); nothing was written")
    assert not info.value.uncertain
    # An unknown database: waiting cannot fix it, so it is raised at once.
    wrong = pgqueue.App(conninfo.make_conninfo(own_server.dsn, dbname="nope"))
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailableError, match='database "nope" does not exist'):
        wrong.enqueue("t", {}, allow_unknown=True)
    assert time.monotonic() - started < wrong.reconnect_timeout


def test_a_commit_that_was_lost_while_waiting_for_a_standby_is_not_retried(
    own_server: EmbeddedPostgres,
) -> None:
    """With synchronous replication a COMMIT is local before the standby confirms it: a session
    terminated during that wait has committed, but its client only sees the connection end.
    The call raises DatabaseUnavailableError(uncertain=True) and never sends the job again."""
    app = pgqueue.App(own_server.dsn)
    outcome: list[object] = []
    with psycopg.connect(own_server.dsn, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        admin.execute("SELECT pg_reload_conf()")
        try:

            def enqueue() -> None:
                try:
                    outcome.append(app.enqueue("t", {"sync": "lost"}, allow_unknown=True))
                except BaseException as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=enqueue)
            thread.start()
            waiting = "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            pid = wait_until(lambda: admin.execute(waiting).fetchone(), what="a SyncRep wait")[0]
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            thread.join(30)
            assert not thread.is_alive()
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")
            app.close()
        rows = admin.execute(
            "SELECT count(*) FROM pgqueue_jobs WHERE args->>'sync' = 'lost'"
        ).fetchone()
    assert len(outcome) == 1 and isinstance(outcome[0], DatabaseUnavailableError), outcome
    assert outcome[0].uncertain
    assert rows == (1,)  # committed locally, once


def test_a_bulk_enqueue_refused_as_read_only_is_not_replayed_but_says_nothing_was_written(
    dsn: str, conn: Conn
) -> None:
    """enqueue_many checks its jobs as the COPY consumes them, so it cannot start over: a
    read-only server is DatabaseUnavailableError at once (nothing written), not psycopg's."""
    app = pgqueue.App(dsn, reconnect_timeout=60)
    _set_read_only(conn, True)
    try:
        with pytest.raises(DatabaseUnavailableError, match="is read-only") as info:
            app.enqueue_many([("t", {})] * 3, allow_unknown=True)
    finally:
        _set_read_only(conn, False)
        app.close()
    assert not info.value.uncertain
    assert conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone() == (0,)


def test_read_only_mappings_are_written_as_the_dicts_they_show(
    app: pgqueue.App, conn: psycopg.Connection[Any]
) -> None:
    """A MappingProxyType (arguments, a nested value, meta) passes the checks as the mapping it
    is: it is stored as JSON like a dict, and a unique job's key is the dict's, where it once
    raised json's TypeError with a traceback."""
    from types import MappingProxyType

    @app.task(unique=True)
    def tagged(user: str, tags: dict[str, int]) -> None: ...

    plain = {"user": "ana", "tags": {"a": 1}}
    first = app.enqueue(
        "tagged",
        MappingProxyType({"user": "ana", "tags": MappingProxyType({"a": 1})}),
        meta=MappingProxyType({"from": "web"}),
    )
    again = tagged.enqueue(user="ana", tags={"a": 1})
    assert again == first and again.duplicate  # the same key as the dict's
    stored = conn.execute("SELECT args, meta FROM pgqueue_jobs WHERE id = %s", (first,)).fetchone()
    assert stored == (plain, {"from": "web"})
