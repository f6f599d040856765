"""What works behind PgBouncer, with a real PgBouncer in front of the test database: the claims of
docs/guides/pgbouncer.md.

PgBouncer comes from the system (Debian's `pgbouncer` package; .ci/run installs it). It refuses
to run as root, so as root it runs as the `postgres` user, like the test cluster.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo
from starlette.testclient import TestClient

import pgqueue
from pgqueue.dashboard.app import create_app
from pgqueue.dashboard.database import session_options
from pgqueue.dashboard.refresh import Refresher
from pgqueue.embedded import free_port
from tests.helpers import WorkerProcesses, wait_until, worker_process

pytestmark = pytest.mark.acceptance

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
)
requires_pgbouncer = pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed")
APP = "examples.quickstart:app"
Conn = psycopg.Connection[tuple[Any, ...]]


def version() -> tuple[int, ...]:
    assert PGBOUNCER is not None
    out = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"PgBouncer (\d+)\.(\d+)", out.stdout)
    assert match, out.stdout
    return int(match[1]), int(match[2])


@contextlib.contextmanager
def pgbouncer(dsn: str, mode: str, **settings: str) -> Iterator[str]:
    """PgBouncer in ``mode`` in front of ``dsn``'s server; yields a DSN that goes through it."""
    assert PGBOUNCER is not None
    params = conninfo.conninfo_to_dict(dsn)
    user = str(params.get("user") or pwd.getpwuid(os.getuid()).pw_name)
    tmp = Path(tempfile.mkdtemp(prefix="pgqueue-pgbouncer-"))
    demote: Callable[[], None] | None = None
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(tmp, pw.pw_uid, pw.pw_gid)

        def demote() -> None:
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)

    port = free_port()
    (tmp / "users.txt").write_text(f'"{user}" ""\n')
    extra = "".join(f"{key} = {value}\n" for key, value in settings.items())
    (tmp / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={params.get('host', '127.0.0.1')} port={params.get('port', '5432')}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {tmp}/users.txt\n"
        f"pool_mode = {mode}\nmax_client_conn = 200\ndefault_pool_size = 20\n"
        f"logfile = {tmp}/pgbouncer.log\n{extra}"
    )
    proc = subprocess.Popen(
        [PGBOUNCER, str(tmp / "pgbouncer.ini")], preexec_fn=demote, stderr=subprocess.DEVNULL
    )
    through = conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(port))
    try:

        def accepting() -> bool:
            try:
                psycopg.connect(through, connect_timeout=2).close()
            except psycopg.OperationalError:
                assert proc.poll() is None, (tmp / "pgbouncer.log").read_text()
                return False
            return True

        wait_until(accepting, timeout=15, interval=0.1)
        yield through
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def succeeded(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE status = 'succeeded'").fetchone()
    assert row is not None
    return int(row[0])


@requires_pgbouncer
@pytest.mark.timeout(120)
def test_session_pooling_runs_producers_and_a_listening_worker(dsn: str, conn: Conn) -> None:
    with pgbouncer(dsn, "session") as through:
        producer = pgqueue.App(through)
        try:
            for n in range(20):
                producer.enqueue("greet", {"name": f"user{n}"}, allow_unknown=True)
            # A 60 s poll: a job enqueued after the first batch runs promptly only if the
            # worker's LISTEN through PgBouncer receives the NOTIFY.
            with worker_process(through, "--poll-interval", "60", "--concurrency", "4", app=APP):
                wait_until(lambda: succeeded(conn) == 20, timeout=60)
                producer.enqueue("greet", {"name": "late"}, allow_unknown=True)
                wait_until(lambda: succeeded(conn) == 21, timeout=20)
        finally:
            producer.close()


@requires_pgbouncer
@pytest.mark.timeout(120)
def test_transaction_pooling_needs_pgbouncers_prepared_statement_support(
    dsn: str, conn: Conn
) -> None:
    """Before 1.21 PgBouncer cannot carry psycopg's prepared statements across server
    connections; from 1.21, with max_prepared_statements, producers and a --no-listen worker
    work."""
    supported = version() >= (1, 21)
    settings = {"max_prepared_statements": "200"} if supported else {}
    jobs = 40  # psycopg prepares a statement after a few executions on a connection
    with pgbouncer(dsn, "transaction", **settings) as through:
        # Two producers, as two web processes would: each prepares the same statement names,
        # on whichever server connection PgBouncer gives its transaction.
        producers = [pgqueue.App(through), pgqueue.App(through)]
        try:
            if not supported:
                with pytest.raises(psycopg.errors.ProgrammingError, match="prepared statement"):
                    for n in range(jobs):
                        producers[n % 2].enqueue("greet", {"name": "x"}, allow_unknown=True)
                return
            for n in range(jobs):
                producers[n % 2].enqueue("greet", {"name": "x"}, allow_unknown=True)
        finally:
            for producer in producers:
                producer.close()
        with worker_process(through, "--no-listen", "--poll-interval", "0.2", app=APP):
            wait_until(lambda: succeeded(conn) == jobs, timeout=60)


@requires_pgbouncer
@pytest.mark.timeout(120)
def test_transaction_pooling_works_on_any_version_without_prepared_statements(
    dsn: str, conn: Conn, tmp_path: Path
) -> None:
    """prepared_statements=False (PGQUEUE_PREPARED_STATEMENTS=off for the CLI): producers and a
    --no-listen worker through transaction pooling, no max_prepared_statements needed. Every
    statement runs many times on each connection: claims, acks and heartbeats well past
    psycopg's preparation threshold."""
    with pgbouncer(dsn, "transaction") as through:
        producer = pgqueue.App(through, prepared_statements=False)
        env = {"PGQUEUE_PREPARED_STATEMENTS": "off"}
        procs = WorkerProcesses(through, APP, tmp_path, env)
        try:
            # Heartbeats (and reaper rounds) every 0.1 s; a lease long enough that a loaded
            # machine's pause is not a lost lease (attempts stay 1).
            procs.start("--no-listen", "--poll-interval", "0.05", "--concurrency", "2",
                        "--lease", "5", "--heartbeat-interval", "0.1")  # fmt: skip
            for round_ in range(1, 4):
                for _ in range(40):
                    producer.enqueue("greet", {"name": "x"}, allow_unknown=True)
                expected = 40 * round_
                wait_until(lambda: succeeded(conn) == expected, timeout=60)  # noqa: B023
            row = conn.execute(
                "SELECT max(attempts), count(*) FILTER (WHERE last_error IS NOT NULL)"
                " FROM pgqueue_jobs"
            ).fetchone()
            assert row == (1, 0)
        finally:
            producer.close()
            procs.stop_all(15)
        assert "prepared statement" not in procs.output()
        assert all(proc.returncode == 0 for proc in procs.procs), procs.output()


def test_prepared_statements_setting_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGQUEUE_PREPARED_STATEMENTS", "off")
    assert pgqueue.App("postgresql://x/y").connect_options == {"prepare_threshold": None}
    assert pgqueue.App("postgresql://x/y", prepared_statements=True).connect_options == {}
    monkeypatch.setenv("PGQUEUE_PREPARED_STATEMENTS", "maybe")
    with pytest.raises(pgqueue.ConfigurationError, match="must be on or off"):
        pgqueue.App("postgresql://x/y")


@requires_pgbouncer
def test_pgbouncer_accepts_the_dashboards_connection(dsn: str) -> None:
    """Its read-only guards are per transaction, not startup `options` (which PgBouncer before
    1.20 refuses)."""
    with (
        pgbouncer(dsn, "session") as through,
        psycopg.connect(through, **session_options()) as dashboard,
    ):
        # Nor does it prepare statements, which transaction pooling before 1.21 cannot carry.
        assert dashboard.prepare_threshold is None


@requires_pgbouncer
@pytest.mark.timeout(120)
def test_unique_jobs_through_transaction_pooling(dsn: str, conn: Conn) -> None:
    """Unique enqueues use more than one statement (an ON CONFLICT fallback, a savepoint around
    the optimistic COPY, a pipeline of chunks): each stays inside one transaction, so a
    transaction-pooling PgBouncer serves them like any other enqueue."""
    with pgbouncer(dsn, "transaction") as through:
        producer = pgqueue.App(through, prepared_statements=False)
        try:
            first = producer.enqueue("greet", {"name": "a"}, unique_key="a", allow_unknown=True)
            again = producer.enqueue("greet", {"name": "b"}, unique_key="a", allow_unknown=True)
            assert again.duplicate and again == first
            batch: list[Any] = [
                {"task": "greet", "args": {"name": str(n)}, "unique_key": str(n % 700)}
                for n in range(1400)
            ]
            assert producer.enqueue_many(batch, allow_unknown=True) == 700
            conn.execute("UPDATE pgqueue_jobs SET status = 'succeeded', finished_at = now()")
            assert producer.enqueue_many(batch, allow_unknown=True) == 700
            assert not producer.enqueue(
                "greet", {"name": "c"}, unique_key="a", allow_unknown=True
            ).duplicate
        finally:
            producer.close()


@requires_pgbouncer
@pytest.mark.timeout(120)
def test_the_dashboard_through_transaction_pooling(dsn: str, conn: Conn) -> None:
    """Two dashboards (as two replicas of a deployment would be) through one transaction-pooling
    PgBouncer with a small pool, so their transactions land on whichever server connection is
    free: many refreshes each with no failure, the same figures as PostgreSQL itself, a job's
    page and its JSON, and no setting left behind on the server connections."""
    producer = pgqueue.App(dsn)
    try:
        ids = [producer.enqueue("greet", {"name": f"u{n}"}, allow_unknown=True) for n in range(7)]
        producer.enqueue("report", {}, queue="reports", allow_unknown=True)
    finally:
        producer.close()
    job_id = int(ids[0])
    with (
        pgbouncer(dsn, "transaction", default_pool_size="2") as through,
        TestClient(create_app(through, refresh_interval=0.05), base_url="http://127.0.0.1") as a,
        TestClient(create_app(through, refresh_interval=0.05), base_url="http://127.0.0.1") as b,
    ):
        refreshers: list[Refresher] = [a.app.state.refresher, b.app.state.refresher]  # type: ignore[attr-defined]
        # Far past psycopg's fifth execution of every statement on each connection.
        wait_until(lambda: all(r.refreshes >= 40 for r in refreshers), timeout=60)
        assert [r.failures for r in refreshers] == [0, 0], [r._down_reason for r in refreshers]
        for client in (a, b):
            snap = client.get("/api/snapshot").json()
            assert snap["status"] == "ok"
            assert snap["tiles"]["queued"] == 8
            assert {q["queue"]: q["queued"] for q in snap["queues"]} == {"default": 7, "reports": 1}
            page = client.get(f"/jobs/{job_id}")
            assert page.status_code == 200 and "greet" in page.text
            api = client.get(f"/api/jobs/{job_id}").json()
            assert (api["id"], api["task"], api["status"]) == (job_id, "greet", "queued")
            assert client.get("/readyz").text == "ok"
        # Every dashboard read was READ ONLY with a local statement_timeout: a plain client on
        # the same pool's server connections finds neither.
        with psycopg.connect(through, autocommit=True) as plain:
            for _ in range(4):
                row = plain.execute(
                    "SELECT current_setting('transaction_read_only'),"
                    " current_setting('statement_timeout'), current_setting('enable_seqscan')"
                ).fetchone()
                assert row == ("off", "0", "on")
