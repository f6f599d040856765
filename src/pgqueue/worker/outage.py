"""The worker's view of whether PostgreSQL is reachable: one warning when its services start
failing to reach it, one line when they reach it again, and nothing in between.

During a failover (the primary gone, a standby being promoted) every service fails every round:
the claim, the acks, the heartbeat, the reaper, the scheduler, LISTEN, the stats. Each keeps
retrying with its own backoff; without this, each round would log its own warning. A failure
counts as the database being unreachable when it says nothing about the statement itself: a
connection that could not be made or was lost (SQLSTATE class 08, 57P0x, no SQLSTATE at all,
a pool timeout), or a read-only server (25006: a standby not promoted yet).

After the database is back, connections a pool opened before the outage still fail once each
as they are used. A failure within ``SETTLE`` seconds of a recovery is therefore kept quiet
(logged at debug level) unless the database stays unreachable for ``SETTLE`` seconds, when the
outage is reported after all. psycopg_pool's own warnings about the same connections (one per
connection attempt) are left out of the log while an outage is on or settling
(``PoolNoise``): this service's two lines say it once.
"""

from __future__ import annotations

import logging
import math
import time

import psycopg
from psycopg_pool import PoolTimeout

log = logging.getLogger("pgqueue.worker")

#: Seconds after a recovery during which a failure is taken for a connection left over from
#: before the outage, not for a new outage (unless failures last this long).
SETTLE = 10.0


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached (or is read-only), rather than
    something about the statement that failed."""
    cause = exc.__cause__
    if cause is not None and not isinstance(exc, psycopg.Error | OSError):
        return unreachable(cause)  # a wrapper, like the completer's TransientWriteError
    if isinstance(exc, OSError | TimeoutError | PoolTimeout):
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state is None:
            return isinstance(exc, psycopg.OperationalError)
        return state[:2] == "08" or state.startswith("57P") or state == "25006"
    return False


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].rsplit(" failed: ", 1)[-1] if lines else type(exc).__name__


class Outage:
    def __init__(self) -> None:
        #: Monotonic time the current outage began (None: the database is reachable).
        self.since: float | None = None
        #: The current outage has been logged (False while it may be a leftover connection).
        self.reported = False
        self.recovered_at = -math.inf
        #: Outages reported so far, and failed rounds in the current one.
        self.outages = 0
        self.rounds = 0

    @property
    def noisy(self) -> bool:
        """An outage is on, or ended less than SETTLE seconds ago."""
        return self.since is not None or time.monotonic() - self.recovered_at < SETTLE

    def failed(self, what: str, exc: BaseException) -> bool:
        """A round of ``what`` failed with ``exc``: True if that is the database being
        unreachable, which is then logged here (once per outage)."""
        if not unreachable(exc):
            return False
        now = time.monotonic()
        self.rounds += 1
        if self.since is None:
            self.since = now
            self.rounds = 1
            self.reported = False
        if not self.reported and (now - self.recovered_at >= SETTLE or now - self.since >= SETTLE):
            self.reported = True
            self.outages += 1
            log.warning(
                "PostgreSQL is unreachable (%s: %s); every service retries with backoff, "
                "running jobs go on while the worker's lease lasts",
                what, _reason(exc),
            )  # fmt: skip
        else:
            log.debug("%s failed (%s); will retry", what, _reason(exc))
        return True

    def ok(self) -> None:
        """A round reached the database."""
        if self.since is None:
            return
        now = time.monotonic()
        if self.reported:  # at the warning's level: a log filtered to warnings shows the end too
            log.warning(
                "PostgreSQL is reachable again after %.1f s (%d failed rounds)",
                now - self.since, self.rounds,
            )  # fmt: skip
        else:
            log.debug("PostgreSQL reachable again (%d failed rounds)", self.rounds)
        self.since = None
        self.recovered_at = now


#: psycopg_pool's warnings about connections an outage broke or could not make.
_POOL_NOISE = (
    "error connecting in %r: %s",
    "reconnection attempt in pool %r failed after %s sec",
    "discarding closed connection: %s",
    "discarding broken connection: %s",
    "error resetting connection: %s",
)


class PoolNoise(logging.Filter):
    """Leaves psycopg_pool's per-connection warnings about the worker's own connections out of
    the log (install on the ``psycopg.pool`` logger): the outage's lines say it. A connection
    discarded as broken is the first sign of an outage, before any service noticed it, so it
    is told by its application name; other pools' warnings are left alone."""

    def __init__(self, outage: Outage, application_name: str) -> None:
        super().__init__()
        self.outage = outage
        self.prefix = application_name.encode()

    def filter(self, record: logging.LogRecord) -> bool:
        # It runs inside psycopg_pool's code, which logs a closed connection's warning right
        # before it replaces the connection: an exception here skipped the replacement and the
        # pool lost that slot for good (a handler pool with none left made every later job
        # wait for ever). Whatever goes wrong, the record is kept.
        try:
            return self._keep(record)
        except Exception:
            return True

    def _keep(self, record: logging.LogRecord) -> bool:
        if record.msg not in _POOL_NOISE:
            return True
        subject = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if isinstance(subject, str):  # a pool's name
            return not (subject.startswith("pgqueue-worker") and self.outage.noisy)
        if isinstance(subject, BaseException):  # a reset that met the lost connection
            return not unreachable(subject)
        if isinstance(subject, psycopg.BaseConnection):
            try:
                name = subject.pgconn.parameter_status(b"application_name") or b""
            except psycopg.OperationalError:
                # Closed by psycopg itself (a cancelled query whose cancel went unanswered):
                # its parameters went with it, so whose it was cannot be told.
                return not self.outage.noisy
            return not name.startswith(self.prefix)
        return True
