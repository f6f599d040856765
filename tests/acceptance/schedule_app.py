"""The app that the schedule acceptance tests run as `pgqueue worker --app ...` subprocesses.

``PGQUEUE_TEST_CLOCK_OFFSET`` (seconds) skews this process's wall clock (``time.time`` and
``datetime.datetime.now``), as a worker on a badly synced host would see it;
``PGQUEUE_TEST_MISSED`` picks the missed-tick policy of the per-second schedule.
"""

from __future__ import annotations

import os

import pgqueue
from tests import clock_skew  # noqa: F401  (skews the clock when asked)

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
