"""Many event loops in one process, each enqueueing through the same App, as a script or a
Celery-style task that calls ``asyncio.run()`` every time does. Run as a subprocess by
``test_producer_connections`` (so a hang fails that test, not the suite):

    python -m tests.producer_loops DSN {asyncio|uvloop} {enqueue|failing|refused} LOOPS

It prints one JSON object: the server connections of the database seen while each loop ran
(``during``) and once it had ended (``after``), and the errors its first enqueue raised.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable

import psycopg

import pgqueue
from pgqueue.worker.runtime import loop_factory

#: Client sessions only: an autovacuum worker visiting the database shows in pg_stat_activity
#: too (a clean-clone CI run once counted 2 connections for one loop).
COUNT = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
)


def main(dsn: str, loop: str, mode: str, loops: int) -> None:
    target = "postgresql://postgres@127.0.0.1:1/refused" if mode == "refused" else dsn
    # Refused at once: this measures the loops' cleanup, not the retries (reconnect_timeout).
    app = pgqueue.App(target, reconnect_timeout=0)
    factory: Callable[[], asyncio.AbstractEventLoop] | None = loop_factory(loop)
    errors: list[str] = []
    during: list[int] = []
    after: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as monitor:

        def connections() -> int:
            row = monitor.execute(COUNT).fetchone()
            assert row is not None
            return int(row[0])

        async def one_loop() -> int:
            if mode == "enqueue":
                # Concurrent enqueues, so the loop holds more than one connection.
                await asyncio.gather(
                    *(app.enqueue_async("t", {"n": n}, allow_unknown=True) for n in range(3))
                )
                await app.enqueue_many_async(
                    [("t", {"n": n}) for n in range(5)], allow_unknown=True
                )
            else:
                try:
                    await app.enqueue_async("t", {}, allow_unknown=True)
                except (pgqueue.PgQueueError, psycopg.Error) as exc:
                    errors.append(type(exc).__name__)
            return connections()

        for _ in range(loops):
            with asyncio.Runner(loop_factory=factory) as runner:
                during.append(runner.run(one_loop()))
            # A closed connection's server process takes a moment to leave pg_stat_activity.
            deadline = time.monotonic() + 10
            while (count := connections()) and time.monotonic() < deadline:
                time.sleep(0.01)
            after.append(count)
    print(json.dumps({"during": during, "after": after, "errors": sorted(set(errors))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
