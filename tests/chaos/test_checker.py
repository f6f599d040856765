"""The checker's recovery times, on a history written by hand into a real database: a worker
hit by two faults that renewed its lease between them is measured from the fault that made the
lease run out, and a lapse renewed before any reaper came still counts against the bound."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

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


@pytest.mark.parametrize(
    ("reaped", "expires", "lapses", "faults", "expected"),
    [
        # Fault at 1 (healed, lease renewed at 4.5, so it ran out at 6.5); fault at 5; reaped at
        # 7: 2 s after the fault that made the lease run out (6 s after the first).
        (7, 6.5, [], [("blackhole", 1), ("blackhole", 5)], [2.0]),
        # Fault at 1, lease ran out at 2.5 and nobody reaped it until the worker renewed at 9;
        # fault at 10, reaped at 12.5: the job waited 8 s for the first recovery, over the bound.
        (12.5, 12.0, [(2.5, 9)], [("sigstop", 1), ("sigstop", 10)], [2.5, 8.0]),
        # Fault at 1, lease ran out at 2.6, the reaper read it lapsed and committed at 3.2, just
        # after the worker's renewal at 3.1 (the transition logs the renewed expiry, 5.1).
        (3.2, 5.1, [(2.6, 3.1)], [("blackhole", 1)], [2.2]),
    ],
    ids=["renewed between two faults", "a lapse renewed before any reap", "reaped as renewed"],
)
def test_recovery_counts_from_the_fault_that_made_the_lease_run_out(
    conn: psycopg.Connection[Any],
    reaped: float,
    expires: float,
    lapses: list[tuple[float, float]],
    faults: list[tuple[str, float]],
    expected: list[float],
) -> None:
    """A job claimed at 0 by a worker hit by ``faults`` (kind, second), whose lease lapsed and
    was renewed at ``lapses``, reaped at ``reaped`` with the lease expiring at ``expires``."""
    history.install(conn)
    worker = uuid.uuid4()
    _claim_and_reap(conn, worker, claimed=0, reaped=reaped, expires=expires)
    for expired, renewed in lapses:
        conn.execute(
            "INSERT INTO history_lapses (worker_id, expired_at, renewed_at) VALUES (%s, %s, %s)",
            (worker, at(expired), at(renewed)),
        )
    hits = [Fault(kind, at(second), worker) for kind, second in faults]
    assert sorted(round(t, 3) for t in recovery_times(conn, hits, LEASE)) == expected
