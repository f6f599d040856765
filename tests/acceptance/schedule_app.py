"""The app that the schedule acceptance tests run as `pgqueue worker --app ...` subprocesses.

``PGQUEUE_TEST_CLOCK_OFFSET`` (seconds) skews this process's wall clock (``time.time`` and
``datetime.datetime.now``), as a worker on a badly synced host would see it;
``PGQUEUE_TEST_MISSED`` picks the missed-tick policy of the per-second schedule.
"""

from __future__ import annotations

import datetime as _dt
import os
import time

import pgqueue

_OFFSET = float(os.environ.get("PGQUEUE_TEST_CLOCK_OFFSET", "0"))
if _OFFSET:
    _real_time = time.time

    def _skewed_time() -> float:
        return _real_time() + _OFFSET

    class _SkewedDatetime(_dt.datetime):
        @classmethod
        def now(cls, tz: _dt.tzinfo | None = None) -> _SkewedDatetime:
            return cls.fromtimestamp(_skewed_time(), tz)

    time.time = _skewed_time
    _dt.datetime = _SkewedDatetime  # type: ignore[misc]


app = pgqueue.App()


@app.periodic(
    cron="* * * * * *",
    name="every-second",
    missed="all" if os.environ.get("PGQUEUE_TEST_MISSED") == "all" else "latest",
    max_catchup=5,
)
@app.task
def beat() -> None:
    """Does nothing: the tests count the jobs, not their effects."""
