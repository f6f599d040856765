"""The app of the upgrade tests' worker processes: one quick task, so that completions go on at
the rate jobs arrive."""

from __future__ import annotations

import pgqueue

app = pgqueue.App()


@app.task
def touch(n: int = 0) -> int:
    return n
