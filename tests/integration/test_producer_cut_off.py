"""A producer cut off from the network in the middle of a bulk enqueue's COPY, or of a chain's
or a group's transaction, must not hold its jobs' unique keys and its session for hours. The
server waits for a COPY's next chunk, and between a transaction's statements, with no timeout,
and an enqueue of a key that the transaction wrote waits for it; with the server's default
keepalives the server noticed the vanished client after about two hours. pgqueue's own
transactions now ask the server to probe their client as pgqueue probes the server
(``database_now_bounded``), so the server drops it within about 15 s and the keys are free.

A userspace proxy cannot show this: its kernel answers the server's keepalive probes for the
vanished client. The test drops the connection's packets with iptables, which needs root and
CAP_NET_ADMIN (skipped without them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import psycopg
import pytest

import pgqueue
from tests.helpers import wait_until

IPTABLES = shutil.which("iptables")
KEY = "cut-off-mid-copy"
#: The server's probes (5 s idle, then 5 probes 2 s apart, or 15 s unacknowledged) end the
#: transaction about 15 s after the cut; the default keepalives would take two hours.
BOUND = 40.0


def _iptables(*args: str) -> bool:
    assert IPTABLES is not None
    done = subprocess.run([IPTABLES, "-w", *args], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def _rule(action: str, flag: str, port: int) -> bool:
    return _iptables(action, "INPUT", "-p", "tcp", flag, str(port), "-j", "DROP")


class Network:
    """Drops every TCP packet to or from one local port (both directions of one connection,
    silently, as a network that went away does) until healed."""

    def __init__(self) -> None:
        self.dropped: list[tuple[str, int]] = []

    def drop(self, port: int) -> None:
        for flag in ("--sport", "--dport"):
            assert _rule("-I", flag, port)
            self.dropped.append((flag, port))

    def heal(self) -> None:
        while self.dropped:
            flag, port = self.dropped.pop()
            _rule("-D", flag, port)


@pytest.fixture
def network() -> Iterator[Network]:
    if IPTABLES is None or os.geteuid() != 0:
        pytest.skip("needs iptables and root to drop one connection's packets")
    if not (_rule("-I", "--dport", 9) and _rule("-D", "--dport", 9)):
        pytest.skip("iptables cannot change this machine's rules (CAP_NET_ADMIN)")
    network = Network()
    try:
        yield network
    finally:
        network.heal()


def _key_held(conn: psycopg.Connection[Any]) -> bool:
    """Whether an uncommitted insert holds KEY: an insert of it waits (and gives up at once)."""
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL lock_timeout = '200ms'")
            conn.execute(
                "INSERT INTO pgqueue_jobs (queue, task, args, unique_key)"
                " VALUES ('default', 'probe', '{}', %s)"
                " ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING",
                [f"bulk:{KEY}"],  # as stored: the task's name, then the key
            )
    except psycopg.errors.LockNotAvailable:
        return True
    return False


def _copy_client_port(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND query LIKE 'COPY %%'"
    ).fetchone()
    return None if row is None else int(row[0])


class Vanished(Exception):
    """The producer's host, gone: what it was writing never goes on."""


class VanishingProducer:
    """``work`` in a thread of its own (from ``start()``) that calls ``vanish()`` at the point
    under test: there it stops, as a producer whose host went away, until ``end()`` lets it
    fail."""

    def __init__(self, work: Callable[[], object]) -> None:
        self.stalled, self.release = threading.Event(), threading.Event()
        self.stalled_at = 0.0
        self.errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:
                self.errors.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def vanish(self) -> NoReturn:
        self.stalled_at = time.monotonic()
        self.stalled.set()
        self.release.wait(120)
        raise Vanished

    def end(self, network: Network) -> None:
        """The network first, so that the producer does not wait for its own 15 s timeout."""
        network.heal()
        self.release.set()
        self.thread.join(60)
        assert len(self.errors) == 1 and not self.thread.is_alive()


@pytest.mark.slow
def test_a_producer_cut_off_mid_copy_frees_its_unique_keys_within_seconds(
    app: pgqueue.App,
    dsn: str,
    conn: psycopg.Connection[Any],
    network: Network,
) -> None:
    def jobs() -> Iterator[dict[str, Any]]:
        # The unique job leads the first chunk of 500, which goes into the COPY before the
        # producer asks for the second; it stops there.
        yield {"task": "bulk", "args": {"n": 0}, "unique_key": KEY}
        for n in range(1, 1_000):
            if n == 600:
                producer.vanish()
            yield {"task": "bulk", "args": {"n": n, "pad": "x" * 100}}

    producer = VanishingProducer(lambda: app.enqueue_many(jobs(), allow_unknown=True))
    producer.start()
    other = pgqueue.App(dsn)
    waiter: threading.Thread | None = None
    try:
        assert producer.stalled.wait(30)
        wait_until(lambda: _key_held(conn), timeout=20)
        port = _copy_client_port(conn)
        if port is None or port < 0:
            pytest.skip("the test server is reached over a Unix socket: no TCP to cut")
        network.drop(port)

        answers: list[pgqueue.Enqueued | BaseException] = []

        def wait() -> None:
            try:
                answers.append(other.enqueue("bulk", {"n": 0}, unique_key=KEY, allow_unknown=True))
            except BaseException as exc:
                answers.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(BOUND)
        assert answers, f"the key was still held {BOUND:.0f} s after the producer vanished"
        answered = time.monotonic()
        # The producer's transaction rolled back: the waiting enqueue wrote the key's job.
        assert isinstance(answers[0], pgqueue.Enqueued), answers[0]
        assert not answers[0].duplicate
        count = conn.execute("SELECT count(*) FROM pgqueue_jobs WHERE task = 'bulk'").fetchone()
        assert count == (1,)
        # Ended by the server's probes (15 s after the client's last packet, which came at
        # most a moment before it stalled), not by anything sooner.
        assert answered - producer.stalled_at > 10, answered - producer.stalled_at
    finally:
        producer.end(network)
        if waiter is not None:
            waiter.join(60)
        other.close()


def _keepalives_idle(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SHOW tcp_keepalives_idle").fetchone()
    assert row is not None
    return row[0]


def test_a_bulk_enqueue_leaves_no_setting_behind(dsn: str) -> None:
    """The bound lasts the bulk enqueue's own transaction: its pooled connection is as it was
    afterwards, and a caller's transaction (``connection=``) is never given it."""
    with psycopg.connect(dsn) as fresh:
        default = _keepalives_idle(fresh)
    assert default != "5"
    with pgqueue.App(dsn, pool_size=1) as app:
        assert app.enqueue_many([("bulk", {"n": n}) for n in range(600)], allow_unknown=True) == 600
        # The pool's one connection, the one the COPY ran on.
        assert app._sync_pool().run(_keepalives_idle) == default
        with psycopg.connect(dsn) as caller, caller.transaction():
            written = app.enqueue_many(
                [("bulk", {"n": n}) for n in range(600)], connection=caller, allow_unknown=True
            )
            assert written == 600
            assert _keepalives_idle(caller) == default


def _idle_in_transaction(conn: psycopg.Connection[Any]) -> tuple[int, int] | None:
    row = conn.execute(
        "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state = 'idle in transaction'"
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


def _session_gone(conn: psycopg.Connection[Any], pid: int) -> bool:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return row == (0,)


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["chain", "group"])
def test_a_producer_cut_off_inside_a_workflow_is_dropped_within_seconds(
    app: pgqueue.App,
    conn: psycopg.Connection[Any],
    network: Network,
    monkeypatch: pytest.MonkeyPatch,
    workflow: str,
) -> None:
    """A chain or a group is one transaction of several statements: between two of them the
    server waits for the client, idle in it, with no timeout unless the server sets one. A
    producer that vanishes there held a chain's first key, the NOTIFY trigger's shared lock
    (waiting workers then poll) and vacuum's horizon until TCP gave up."""

    @app.task
    def step(n: int) -> int:
        return n

    @app.task
    def total(results: list[int]) -> int:
        return sum(results)

    insert = pgqueue.producer.insert
    calls = 0

    def vanishing_insert(*args: Any, **kwargs: Any) -> Any:
        # A chain's second step, a group's callback: a statement of the workflow ran before.
        nonlocal calls
        calls += 1
        if calls == (2 if workflow == "chain" else 1):
            producer.vanish()
        return insert(*args, **kwargs)

    monkeypatch.setattr(pgqueue.producer, "insert", vanishing_insert)

    def work() -> object:
        if workflow == "chain":
            return app.chain(step.s(n=1), step.s(n=2))
        return app.group([step.s(n=n) for n in range(3)], then=total.s())

    producer = VanishingProducer(work)
    producer.start()
    try:
        assert producer.stalled.wait(30)
        session = wait_until(lambda: _idle_in_transaction(conn), timeout=20)
        assert session is not None
        pid, port = session
        if port < 0:
            pytest.skip("the test server is reached over a Unix socket: no TCP to cut")
        network.drop(port)
        wait_until(
            lambda: _session_gone(conn, pid),
            timeout=BOUND,
            what=f"the vanished producer's session ended within {BOUND:.0f} s",
        )
        assert time.monotonic() - producer.stalled_at > 10  # by the server's probes
        count = conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone()
        assert count == (0,)
    finally:
        producer.end(network)
