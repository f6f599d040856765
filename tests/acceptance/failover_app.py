"""The app that the failover tests run as `pgqueue worker --app ...` subprocesses, connected to
a primary and its standby by one multi-host DSN (tests/replication.py).

``note`` is a plain job; ``effect`` writes one row per attempt in its ack's transaction
(transactional completion), so the rows of ``failover_effects`` are the job's database effects:
exactly one per succeeded job, whatever ran twice. Both carry a token of the producer's own,
since after an asynchronous failover a lost job's id can be given to another job.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

import pgqueue

app = pgqueue.App(backoff=pgqueue.Backoff(base=0.1, cap=0.5))

INSTALL = """
CREATE TABLE IF NOT EXISTS failover_effects (
    token  text NOT NULL,
    job_id bigint NOT NULL,
    at     timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


@app.task(max_attempts=50)
async def note(token: str) -> str:
    await asyncio.sleep(0.005)
    return token


@app.task(max_attempts=50)
async def effect(ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any], token: str) -> str:
    await conn.execute(
        "INSERT INTO failover_effects (token, job_id) VALUES (%s, %s)", (token, ctx.job_id)
    )
    await asyncio.sleep(0.005)
    return token
