"""Waiting on conditions with deadlines (never sleep-and-hope), and running workers in tests.

Deadlines are generous (30 s by default): they cost time only when a test fails, and a loaded
2-core machine (two test processes, the workers, PostgreSQL and whatever else runs) can take
seconds for what takes milliseconds alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

import pgqueue
from pgqueue.db import channel_for
from pgqueue.embedded import EmbeddedPostgres
from pgqueue.limits import group_name
from pgqueue.sql import queries
from pgqueue.testing.databases import TemplateDatabases
from pgqueue.worker.fetcher import LIMIT_CLAIM_IDLE_MS, read_head
from pgqueue.worker.runtime import Worker
from tests.chaos.proxy import BlackholeProxy

ROOT = Path(__file__).resolve().parent.parent


def sqlalchemy_url(dsn: str) -> str:
    """The test database as a SQLAlchemy URL on the psycopg (3) driver."""
    from sqlalchemy import URL

    params = {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items() if v is not None}
    url = URL.create(
        "postgresql+psycopg", username=params.get("user"), password=params.get("password"),
        host=params.get("host"), port=int(params.get("port") or 5432),
        database=params.get("dbname"),
    )  # fmt: skip
    return url.render_as_string(hide_password=False)


def limited_walk_params(tasks: list[str], scan: int = 16) -> dict[str, Any]:
    """lock_limit_groups' parameters as Fetcher.claim_limited sends them, walking from the
    start, for a worker of ``tasks`` serving every queue."""
    return {"schema": "public", "queues": None, "tasks": tasks, "after_task": "",
            "after_key": "", "scan": scan}  # fmt: skip


def begin_limited_claim(conn: psycopg.Connection[Any], tasks: list[str]) -> list[Any]:
    """The limited claim's transaction up to its walk, as Fetcher.claim_limited runs it (an
    autocommit ``conn``; the caller ends the transaction): the walk's rows."""
    q = queries("public")
    conn.execute("BEGIN")
    conn.execute(q.begin_limited_claim)
    conn.execute(q.limit_claim_settings, {"idle": LIMIT_CLAIM_IDLE_MS})
    return conn.execute(q.lock_limit_groups, limited_walk_params(tasks)).fetchall()


def limited_claim_params(
    worker: uuid.UUID, tasks: list[str], locks: list[Any], limit: int
) -> dict[str, Any]:
    """claim_limited_jobs' parameters for the groups and queues a walk (its rows: ``locks``)
    locked, as Fetcher.claim_limited builds them."""
    groups = [(str(n), str(k)) for kind, n, k, _, locked, *_ in locks if kind == "g" and locked]
    return {
        "worker_id": worker, "token": uuid.uuid4(), "limit": limit, "queues": None,
        "tasks": tasks, "g_tasks": [t for t, _ in groups], "g_keys": [k for _, k in groups],
        "g_names": [group_name(t, k) for t, k in groups],
        "lq": [str(n) for kind, n, _, _, locked, *_ in locks if kind == "q" and locked],
        "blocked": [],
    }  # fmt: skip


def head_claim(
    conn: psycopg.Connection[Any],
    worker: uuid.UUID,
    tasks: list[str],
    limit: int,
    queues: list[str] | None = None,
) -> list[Any]:
    """The limited claim from the head of the queue as Fetcher.claim_head makes it (the same
    statements in one transaction, what to claim chosen by read_head), on an autocommit
    ``conn``: the claimed rows."""
    q = queries("public")
    with conn.transaction():
        conn.execute(q.begin_limited_claim)
        conn.execute(q.limit_claim_settings, {"idle": LIMIT_CLAIM_IDLE_MS})
        found = conn.execute(
            q.lock_head_groups,
            {"schema": "public", "queues": queues, "tasks": tasks, "scan": 2 * limit},
        ).fetchall()
        ids, keys, _, _ = read_head(found, limit)
        if not ids:
            return []
        return conn.execute(
            q.claim_head_jobs,
            {"worker_id": worker, "token": uuid.uuid4(), "ids": ids, "keys": keys},
        ).fetchall()


def give_lease_away(conn: psycopg.Connection[Any], job_id: int) -> uuid.UUID:
    """Another holder takes the job over (as after a reap and a re-claim elsewhere): its new
    lease token, which the old holder's writes no longer match."""
    token = uuid.uuid4()
    conn.execute("UPDATE pgqueue_jobs SET lease_token = %s WHERE id = %s", (token, job_id))
    return token


def register_worker(
    conn: psycopg.Connection[Any], worker_id: uuid.UUID, lease: float = 30.0, schema: str = "public"
) -> None:
    """A worker row whose lease is live for ``lease`` seconds, as a worker registers itself:
    claims need it (a claimed job's lease is its worker's)."""
    conn.execute(
        queries(schema).register_worker,
        {"worker_id": worker_id, "host": "test", "pid": 1, "queues": None, "concurrency": 1,
         "lease": lease, "tasks": None},
    )  # fmt: skip


@contextlib.contextmanager
def listening(
    dsn: str, schema: str = "public", *, waiting: bool = False
) -> Iterator[psycopg.Connection[Any]]:
    """A connection LISTENing on the schema's channel; with ``waiting``, it also says it waits
    for work as an idle worker's notifier does (producers notify only while some worker waits)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_for(schema))))
        if waiting:
            conn.execute(queries(schema).announce_waiting)
        yield conn


def notifications(
    listener: psycopg.Connection[Any], wait: float = 0.3, *, expected: int = 0
) -> list[tuple[str, str]]:
    """(channel, payload) of what arrives: the ``expected`` number of notifications, however
    long a loaded machine takes to deliver them (up to 30 s), then whatever else comes within
    ``wait`` seconds (extras a test must see, or with expected=0 one that must not come)."""
    got = []
    if expected:
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=30, stop_after=expected)]
    return got + [(n.channel, n.payload) for n in listener.notifies(timeout=wait)]


def db_clock(conn: psycopg.Connection[Any]) -> float:
    """The database's now() as epoch seconds: bracket a write between two readings to check
    the times it stored, however long a loaded machine took around it."""
    row = conn.execute("SELECT extract(epoch FROM now())::float8").fetchone()
    assert row is not None
    return float(row[0])


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout:g} s: {what or predicate}")
        time.sleep(interval)


def minute_ahead_of(conn: psycopg.Connection[Any]) -> None:
    """Tests that compare an every-minute (or every-five-minutes) schedule's next tick with
    now() would fail if a minute turned between the write and the check. They start at least
    8 s before the next turn, by the database clock, waiting for it when closer: far more than
    such a test takes, even on a loaded machine."""

    def clear() -> bool:
        row = conn.execute("SELECT extract(second FROM now()) < 52").fetchone()
        return row is not None and bool(row[0])

    wait_until(clear, timeout=15, what="the next minute on the database clock")


async def wait_until_async(
    predicate: Callable[[], Any | Awaitable[Any]],
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {what or predicate}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def running_worker(app: pgqueue.App, **options: Any) -> AsyncIterator[Worker]:
    """An in-process worker for the duration of the block, stopped gracefully after."""
    options.setdefault("install_signal_handlers", False)
    worker = app.worker(**options)
    task = asyncio.create_task(worker.run())
    try:
        await wait_until_async(lambda: worker.started.is_set() or task.done(), timeout=30)
        if task.done():
            task.result()
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)


class WorkerProcesses:
    """Real ``pgqueue worker`` subprocesses on one database; each one's stderr goes to a log
    file that a failing test prints. ``stop_all`` stops them gracefully (SIGTERM), then kills."""

    def __init__(self, dsn: str, app: str, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.dsn = dsn
        self.app = app
        self.logdir = logdir
        self.env = env or {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(
        self, *args: str, env: dict[str, str] | None = None, nice: int = 0
    ) -> subprocess.Popen[bytes]:
        """One more worker; ``nice`` lowers its CPU priority (a test starting dozens keeps
        them from starving the processes of a test running beside it)."""
        environment = {
            **os.environ,
            "PGQUEUE_DSN": self.dsn,
            "PYTHONPATH": str(ROOT),
            **self.env,
            **(env or {}),
        }
        log = self.logdir / f"worker-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                [*(["nice", "-n", str(nice)] if nice else []),  # nice execs: same pid
                 sys.executable, "-m", "pgqueue.cli", "worker", "--app", self.app,
                 "--log-level", "WARNING", *args],
                cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def output(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in self.logs
        )

    def stop_all(self, timeout: float = 30) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def worker_process(
    dsn: str, *args: str, app: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """One real worker process for the duration of the block, stopped gracefully after."""
    with tempfile.TemporaryDirectory(prefix="pgqueue-worker-") as logdir:
        procs = WorkerProcesses(dsn, app, Path(logdir), env)
        try:
            yield procs.start(*args)
        finally:
            procs.stop_all(15)


@contextlib.contextmanager
def proxied(dsn: str) -> Iterator[tuple[BlackholeProxy, str]]:
    """A proxy that can cut the network (tests/chaos/proxy.py) in front of the test's server,
    and the DSN that goes through it."""
    info = conninfo.conninfo_to_dict(dsn)
    host = str(info.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server listens on a Unix socket only")
    proxy = BlackholeProxy(host, int(str(info.get("port") or 5432)))
    try:
        yield proxy, conninfo.make_conninfo(dsn, host="127.0.0.1", port=proxy.port)
    finally:
        proxy.heal()
        proxy.close()


@contextlib.contextmanager
def own_cluster(label: str) -> Iterator[TemplateDatabases]:
    """A PostgreSQL cluster started for the caller alone (initdb + pg_ctl), whatever
    ``PGQUEUE_TEST_DSN`` says, with migrated template databases; stopped at the end."""
    cluster = EmbeddedPostgres().start()
    try:
        server = TemplateDatabases.start(cluster.dsn, label=label)
    except BaseException:
        cluster.stop()
        raise
    try:
        yield server
    finally:
        server.close()
        cluster.stop()
