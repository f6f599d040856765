"""The single-job INSERT sent straight through libpq: what most web requests cost.

``App.enqueue`` outside a caller's transaction runs one statement on one of the app's own
connections, and psycopg's general execute path (placeholder conversion, adaptation by type,
the prepared-statement cache, result wrapping) cost more client CPU than the statement's
round trip (docs/performance.md, "Single enqueue"). Here the statement is prepared once per
connection under its own name, its nine parameters go as text, and the one-value answer is
read as text: psycopg's ``pq`` layer (its public libpq binding) and, for the sync wait, the
connection's own ``wait`` (so Ctrl-C still cancels the query). Anything unusual takes the
general path instead (``eligible``): a connection not in UTF-8, an app told not to prepare
statements (PgBouncer before 1.21), a NUL character (libpq's text parameters end at one, where
the general path refuses it), and unique, child and caller-connection enqueues.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import weakref
from typing import Any

import psycopg
from psycopg import errors, generators
from psycopg.pq import ExecStatus, TransactionStatus

from . import producer
from .jobs import Enqueued
from .producer import JobRow
from .sql import Queries

_PLACEHOLDER = re.compile(rb"%\((\w+)\)s")
#: False sends every insert through psycopg's general path (benchmarks/enqueue_cpu.py compares).
ENABLED = True
#: The parameters of ``insert_job``, in the order JobRow.params gives them.
_ORDER = ("queue", "task", "args", "priority", "run_at", "delay", "max_attempts", "limit_key",
          "meta")  # fmt: skip
#: Statement names prepared on each connection (by its libpq connection object).
_prepared: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


@functools.cache
def statement(insert_job: bytes) -> Statement:
    return Statement(insert_job)


class Statement:
    """``insert_job`` with ``$n`` placeholders, under a name of its own text's hash (so two
    schemas, or two pgqueue versions, never share a name on one connection)."""

    def __init__(self, statement: bytes) -> None:
        names: list[str] = []

        def number(match: re.Match[bytes]) -> bytes:
            name = match.group(1).decode()
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        self.text = _PLACEHOLDER.sub(number, statement)
        if tuple(names) != _ORDER:
            raise RuntimeError(f"insert_job's parameters changed: {names}")
        self.name = b"pgqueue_insert_job_" + hashlib.sha1(self.text).hexdigest()[:16].encode()


def pooled_insert(conn: psycopg.Connection[Any], q: Queries, row: JobRow) -> Enqueued:
    """``producer.insert`` on one of the app's own connections: the direct path when it can."""
    if eligible(conn, row) and (params := parameters(row)) is not None:
        return Enqueued(insert(conn, statement(q.insert_job), params))
    return producer.insert(conn, q, row)


async def pooled_insert_async(
    conn: psycopg.AsyncConnection[Any], q: Queries, row: JobRow
) -> Enqueued:
    """``pooled_insert`` for async code."""
    if eligible(conn, row) and (params := parameters(row)) is not None:
        return Enqueued(await insert_async(conn, statement(q.insert_job), params))
    return await producer.insert_async(conn, q, row)


def parameters(row: JobRow) -> list[bytes | None] | None:
    """The row's parameters as text, or None when one holds a NUL character (the JSON ones
    cannot: json.dumps escapes it)."""
    limit_key, run_at, meta = row.limit_key, row.run_at, row.meta_json
    if "\x00" in row.queue or "\x00" in row.task or (limit_key and "\x00" in limit_key):
        return None
    return [
        row.queue.encode(),
        row.task.encode(),
        row.args_json.encode(),
        b"%d" % row.priority,
        None if run_at is None else run_at.isoformat().encode(),
        repr(float(row.delay)).encode(),
        b"%d" % row.max_attempts,
        None if limit_key is None else limit_key.encode(),
        None if meta is None else meta.encode(),
    ]


def eligible(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], row: JobRow) -> bool:
    """Whether this insert may take the direct path on this (pool) connection."""
    return (
        ENABLED
        and row.after is None
        and row.unique_key is None
        and conn.prepare_threshold is not None
        and conn.pgconn.transaction_status == TransactionStatus.IDLE
        and conn.info.encoding == "utf-8"
    )


def _job_id(results: list[Any]) -> int:
    _job_id_or_ok(results)
    answer = results[-1] if results else None
    if answer is None or answer.status != ExecStatus.TUPLES_OK or answer.ntuples != 1:
        raise psycopg.InterfaceError("unexpected answer to the job INSERT")
    value = answer.get_value(0, 0)
    assert value is not None
    return int(value)


def insert(conn: psycopg.Connection[Any], statement: Statement, params: list[bytes | None]) -> int:
    pgconn = conn.pgconn
    done = _prepared.setdefault(pgconn, set())
    for _ in range(2):
        if statement.name not in done:
            pgconn.send_prepare(statement.name, statement.text)
            _job_id_or_ok(conn.wait(generators.execute(pgconn)))
            done.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        try:
            return _job_id(conn.wait(generators.execute(pgconn)))
        except errors.InvalidSqlStatementName:  # deallocated by code that borrowed the conn
            done.discard(statement.name)
    raise psycopg.InterfaceError("the job INSERT could not be prepared")


async def insert_async(
    conn: psycopg.AsyncConnection[Any], statement: Statement, params: list[bytes | None]
) -> int:
    pgconn = conn.pgconn
    done = _prepared.setdefault(pgconn, set())
    for _ in range(2):
        if statement.name not in done:
            pgconn.send_prepare(statement.name, statement.text)
            _job_id_or_ok(await _results(pgconn))
            done.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        try:
            return _job_id(await _results(pgconn))
        except errors.InvalidSqlStatementName:  # deallocated by code that borrowed the conn
            done.discard(statement.name)
    raise psycopg.InterfaceError("the job INSERT could not be prepared")


def _job_id_or_ok(results: list[Any]) -> None:
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding="utf-8")


async def _results(pgconn: Any) -> list[Any]:
    """Every result of the query just sent. Waits on the socket with the loop's own reader
    callback: psycopg's general async wait costs about a third of this call's CPU. A caller
    cancelled meanwhile leaves the connection busy, so the pool closes it (pools._settled)."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():
        await _ready(loop, fd, write=True)
    results: list[Any] = []
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)
        await _ready(loop, fd, write=False)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
