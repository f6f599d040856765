"""The worker's outage log without a database: one warning when the services start failing to
reach PostgreSQL, one when they reach it again, nothing per round in between, and a connection
left over from before an outage not taken for a new one."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import PoolTimeout

from pgqueue.worker import outage as outages
from pgqueue.worker.completer import TransientWriteError, transient
from pgqueue.worker.outage import Outage, PoolNoise, unreachable
from pgqueue.worker.state import round_failed

LOST = psycopg.OperationalError("consuming input failed: server closed the connection")


def server_error(sqlstate: str) -> psycopg.Error:
    """A psycopg error as PostgreSQL would answer it, with ``sqlstate``."""
    cls = psycopg.errors.lookup(sqlstate)
    return cls("refused")


def wrapped(cause: BaseException) -> TransientWriteError:
    try:
        raise TransientWriteError(str(cause)) from cause
    except TransientWriteError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        LOST,
        OSError("Connection refused"),
        TimeoutError(),
        PoolTimeout("couldn't get a connection after 10.00 sec"),
        server_error("57P01"),  # terminated by a shutdown
        server_error("57P03"),  # the database system is starting up
        server_error("08006"),
        server_error("25006"),  # a standby not promoted yet
        wrapped(LOST),
    ],
    ids=repr,
)
def test_connection_failures_count_as_the_database_unreachable(exc: BaseException) -> None:
    assert unreachable(exc)


@pytest.mark.parametrize(
    "exc",
    [server_error("42P01"), server_error("23505"), server_error("40001"), ValueError("bug")],
    ids=repr,
)
def test_errors_about_the_statement_do_not(exc: BaseException) -> None:
    assert not unreachable(exc)


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def test_one_warning_per_outage_and_one_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("pgqueue.worker.test")
    outage = Outage()
    caplog.set_level(logging.DEBUG)
    for what in ("claim", "heartbeat", "reaper round", "claim", "LISTEN"):
        round_failed(log, what, LOST, outage)
    outage.ok()
    outage.ok()
    (down, up) = messages(caplog)
    assert down.startswith("PostgreSQL is unreachable (claim: server closed the connection); ")
    assert up.startswith("PostgreSQL is reachable again after ") and up.endswith(
        "(5 failed rounds)"
    )
    assert outage.outages == 1


def test_other_errors_keep_their_own_warning(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    round_failed(logging.getLogger("pgqueue.worker.test"), "claim", server_error("42P01"), outage)
    assert messages(caplog) == ["claim failed (refused); will retry"]
    assert outage.since is None


def test_a_failure_just_after_recovery_is_quiet_unless_it_lasts(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pooled connection opened before the outage fails once when next used: not a new
    outage. Failures that go on for SETTLE seconds are one after all."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    outage = Outage()
    outage.failed("claim", LOST)
    now[0] += 3
    outage.ok()
    assert len(messages(caplog)) == 2
    now[0] += 1
    outage.failed("reaper round", LOST)  # a leftover connection
    outage.ok()
    assert len(messages(caplog)) == 2
    now[0] += 1
    outage.failed("claim", LOST)  # down again, for good this time
    now[0] += outages.SETTLE
    outage.failed("claim", LOST)
    assert len(messages(caplog)) == 3
    assert messages(caplog)[2].startswith("PostgreSQL is unreachable (claim: ")
    assert outage.outages == 2


def record(msg: str, *args: Any) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", logging.WARNING, __file__, 1, msg, args, None)


def test_pool_warnings_about_the_workers_own_connections_are_left_out() -> None:
    outage = Outage()
    noise = PoolNoise(outage, "pgqueue-worker:42")
    error = "error connecting in %r: %s"
    # A pool's failed connect: left out during an outage (or just after), kept otherwise.
    assert noise.filter(record(error, "pgqueue-worker", LOST))
    outage.failed("claim", LOST)
    assert not noise.filter(record(error, "pgqueue-worker-acks", LOST))
    assert noise.filter(record(error, "pool-1", LOST))  # the application's own pool
    # A reset that met a lost connection: said by the outage's line.
    assert not noise.filter(record("error resetting connection: %s", LOST))
    assert noise.filter(record("error resetting connection: %s", server_error("42P01")))
    assert noise.filter(record("growing pool %r to %s", "pgqueue-worker", 2))


def test_an_ack_refused_by_a_read_only_server_is_kept_and_retried() -> None:
    """A standby not promoted yet (25006) refuses every write alike: the outage already counted
    it as unreachable, but the ack writer took it for a refusal of the batch's contents and gave
    the attempts up (the jobs then ran again after their leases ran out)."""
    refused = psycopg.errors.ReadOnlySqlTransaction(
        "cannot execute UPDATE in a read-only transaction"
    )
    assert transient(refused, None)
    assert unreachable(refused)
    assert not transient(psycopg.errors.CheckViolation("a value the table refuses"), None)
