"""The app that the routing acceptance test runs as `pgqueue worker --app ...` subprocesses:
queue ``reports`` on the cluster of ``$ROUTING_REPORTS_DSN``, every other on ``$PGQUEUE_DSN``."""

from __future__ import annotations

import os

import pgqueue

app = pgqueue.App(routes={"reports": os.environ.get("ROUTING_REPORTS_DSN", "postgresql:///x")})


@app.task(queue="reports")
def report(n: int) -> int:
    return n * 10


@app.task
def mail(n: int) -> int:
    return n
