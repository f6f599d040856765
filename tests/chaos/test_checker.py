"""The checker's recovery times, on a history written by hand into a real database: a worker
hit by two faults that renewed its lease between them is measured from the fault that made the
lease run out, and a lapse renewed before any reaper came still counts against the bound."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from tests import history
from tests.chaos.checker import Fault, recovery_times

LEASE = 2.0
T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _claim_and_reap(
    conn: psycopg.Connection[Any], worker: uuid.UUID, claimed: float, reaped: float,
    expires: float,
) -> None:  # fmt: skip
    token = uuid.uuid4()
    conn.execute(
        "INSERT INTO history_transitions (job_id, old_status, new_status, new_token, new_worker,"
        " old_attempts, new_attempts, at) VALUES (1, 'queued', 'running', %s, %s, 0, 1, %s)",
        (token, worker, at(claimed)),
    )
    conn.execute(
        "INSERT INTO history_transitions (job_id, old_status, new_status, old_token, old_expires,"
        " new_error, old_attempts, new_attempts, at)"
        " VALUES (1, 'running', 'retrying', %s, %s, 'LeaseExpired: gone', 1, 1, %s)",
        (token, at(expires), at(reaped)),
    )


def test_a_lease_renewed_between_two_faults_counts_from_the_second(
    conn: psycopg.Connection[Any],
) -> None:
    history.install(conn)
    worker = uuid.uuid4()
    # Claimed at 0; fault at 1 (healed, lease renewed at 4.5, so it ran out at 6.5); fault at
    # 5; reaped at 7: 2 s after the fault that made the lease run out, 6 s after the first.
    _claim_and_reap(conn, worker, claimed=0, reaped=7, expires=6.5)
    faults = [Fault("blackhole", at(1), worker), Fault("blackhole", at(5), worker)]
    assert recovery_times(conn, faults, LEASE) == [2.0]


def test_a_lapse_renewed_before_any_reap_still_counts(conn: psycopg.Connection[Any]) -> None:
    history.install(conn)
    worker = uuid.uuid4()
    # Fault at 1, lease ran out at 2.5 and nobody reaped it until the worker renewed at 9;
    # fault at 10, reaped at 12.5: the job waited 8 s for the first recovery, over the bound.
    _claim_and_reap(conn, worker, claimed=0, reaped=12.5, expires=12.0)
    conn.execute(
        "INSERT INTO history_lapses (worker_id, expired_at, renewed_at) VALUES (%s, %s, %s)",
        (worker, at(2.5), at(9)),
    )
    faults = [Fault("sigstop", at(1), worker), Fault("sigstop", at(10), worker)]
    assert sorted(recovery_times(conn, faults, LEASE)) == [2.5, 8.0]


def test_a_reap_of_a_lapse_renewed_as_it_committed_counts_from_its_fault(
    conn: psycopg.Connection[Any],
) -> None:
    history.install(conn)
    worker = uuid.uuid4()
    # Fault at 1, lease ran out at 2.6, the reaper read it lapsed and committed at 3.2, just
    # after the worker's renewal at 3.1 (the transition logs the renewed expiry, 5.1).
    _claim_and_reap(conn, worker, claimed=0, reaped=3.2, expires=5.1)
    conn.execute(
        "INSERT INTO history_lapses (worker_id, expired_at, renewed_at) VALUES (%s, %s, %s)",
        (worker, at(2.6), at(3.1)),
    )
    faults = [Fault("blackhole", at(1), worker)]
    assert [round(t, 3) for t in recovery_times(conn, faults, LEASE)] == [2.2]
