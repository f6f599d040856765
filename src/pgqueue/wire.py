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
the general path refuses it), and child and caller-connection enqueues. A unique job goes the
same way with ``insert_unique_job`` (its own prepared statement), and its key, when the job
holding it no longer holds it, is released through psycopg as on the general path.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
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
#: The parameters of ``insert_job``, in the order ``parameters`` gives them.
_ORDER = ("queue", "task", "args", "priority", "run_at", "delay", "max_attempts", "limit_key",
          "meta")  # fmt: skip
#: The parameters of ``insert_unique_job``, in the order ``unique_parameters`` gives them.
_UNIQUE_ORDER = ("queue", "task", "args", "priority", "run_at", "delay", "max_attempts",
                 "unique_key", "unique_while", "unique_for", "limit_key", "meta",
                 "on_conflict")  # fmt: skip
#: What this module knows of each connection, by its libpq connection object.
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
#: Whether the socket can be duplicated for a reader that outlives one call (``_Watcher``).
_WATCH = os.name == "posix"


class _Session:
    __slots__ = ("prepared", "watcher")

    def __init__(self) -> None:
        #: Statement names prepared on this connection.
        self.prepared: set[bytes] = set()
        self.watcher: _Watcher | None = None


def _session(pgconn: Any) -> _Session:
    session = _sessions.get(pgconn)
    if session is None:
        session = _sessions[pgconn] = _Session()
    return session


@functools.cache
def statement(insert_job: bytes) -> Statement:
    return Statement(insert_job)


@functools.cache
def unique_statement(insert_unique_job: bytes) -> Statement:
    return Statement(insert_unique_job, _UNIQUE_ORDER, b"pgqueue_insert_unique_job_")


class Statement:
    """``insert_job`` (or ``insert_unique_job``) with ``$n`` placeholders, under a name of its
    own text's hash (so two schemas, or two pgqueue versions, never share a name on one
    connection)."""

    def __init__(
        self,
        statement: bytes,
        order: tuple[str, ...] = _ORDER,
        prefix: bytes = b"pgqueue_insert_job_",
    ) -> None:
        names: list[str] = []

        def number(match: re.Match[bytes]) -> bytes:
            name = match.group(1).decode()
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        self.text = _PLACEHOLDER.sub(number, statement)
        if tuple(names) != order:
            raise RuntimeError(f"the statement's parameters changed: {names}")
        self.name = prefix + hashlib.sha1(self.text).hexdigest()[:16].encode()


def pooled_insert(conn: psycopg.Connection[Any], q: Queries, row: JobRow) -> Enqueued:
    """``producer.insert`` on one of the app's own connections: the direct path when it can."""
    if eligible(conn, row):
        if row.unique_key is None:
            if (params := parameters(row)) is not None:
                return Enqueued(insert(conn, statement(q.insert_job), params))
        elif (params := unique_parameters(row)) is not None:
            sql = unique_statement(q.insert_unique_job)
            return producer.insert_unique(
                conn, q, row, lambda: _unique_answer(run(conn, sql, params))
            )
    return producer.insert(conn, q, row)


async def pooled_insert_async(
    conn: psycopg.AsyncConnection[Any], q: Queries, row: JobRow
) -> Enqueued:
    """``pooled_insert`` for async code."""
    if eligible(conn, row):
        if row.unique_key is None:
            if (params := parameters(row)) is not None:
                return Enqueued(await insert_async(conn, statement(q.insert_job), params))
        elif (params := unique_parameters(row)) is not None:
            sql = unique_statement(q.insert_unique_job)

            async def attempt() -> Enqueued | None:
                return _unique_answer(await run_async(conn, sql, params))

            return await producer.insert_unique_async(conn, q, row, attempt)
    return await producer.insert_async(conn, q, row)


def _unique_answer(answer: list[bytes | None] | None) -> Enqueued | None:
    """insert_unique_job's row: the id, whether the job already existed, whether it took the
    new values (booleans as text: 't' or 'f'); None when it answered no row."""
    if answer is None:
        return None
    job_id, duplicate, replaced = answer
    assert job_id is not None
    return Enqueued(int(job_id), duplicate == b"t", replaced == b"t")


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


def unique_parameters(row: JobRow) -> list[bytes | None] | None:
    """``parameters`` of a unique job, in ``_UNIQUE_ORDER``."""
    key = row.unique_key
    if key is None or "\x00" in key or (params := parameters(row)) is None:
        return None
    queue, task, args, priority, run_at, delay, max_attempts, limit_key, meta = params
    while_, for_ = row.unique_while, row.unique_for
    return [
        queue, task, args, priority, run_at, delay, max_attempts, key.encode(),
        None if while_ is None else while_.encode(),
        None if for_ is None else repr(float(for_)).encode(),
        limit_key, meta, row.on_conflict.encode(),
    ]  # fmt: skip


def eligible(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], row: JobRow) -> bool:
    """Whether this insert may take the direct path on this (pool) connection."""
    return (
        ENABLED
        and row.after is None
        and conn.prepare_threshold is not None
        and conn.pgconn.transaction_status == TransactionStatus.IDLE
        # What conn.info.encoding reads, without making a ConnectionInfo per call.
        and conn.pgconn.parameter_status(b"client_encoding") == b"UTF8"
    )


def _row(results: list[Any]) -> list[bytes | None] | None:
    """The statement's one row (its values as text), or None when it returned none."""
    _job_id_or_ok(results)
    answer = results[-1] if results else None
    if answer is None or answer.status != ExecStatus.TUPLES_OK or answer.ntuples > 1:
        raise psycopg.InterfaceError("unexpected answer to the job INSERT")
    if answer.ntuples == 0:
        return None
    return [answer.get_value(0, column) for column in range(answer.nfields)]


def _job_id(answer: list[bytes | None] | None) -> int:
    if answer is None or answer[0] is None:
        raise psycopg.InterfaceError("unexpected answer to the job INSERT")
    return int(answer[0])


def insert(conn: psycopg.Connection[Any], statement: Statement, params: list[bytes | None]) -> int:
    return _job_id(run(conn, statement, params))


async def insert_async(
    conn: psycopg.AsyncConnection[Any], statement: Statement, params: list[bytes | None]
) -> int:
    return _job_id(await run_async(conn, statement, params))


def run(
    conn: psycopg.Connection[Any], statement: Statement, params: list[bytes | None]
) -> list[bytes | None] | None:
    """Run a prepared statement of this module; its one row (see ``_row``)."""
    pgconn = conn.pgconn
    done = _session(pgconn).prepared
    for _ in range(2):
        if statement.name not in done:
            pgconn.send_prepare(statement.name, statement.text)
            _job_id_or_ok(conn.wait(generators.execute(pgconn)))
            done.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        try:
            return _row(conn.wait(generators.execute(pgconn)))
        except errors.InvalidSqlStatementName:  # deallocated by code that borrowed the conn
            done.discard(statement.name)
    raise psycopg.InterfaceError("the job INSERT could not be prepared")


async def run_async(
    conn: psycopg.AsyncConnection[Any], statement: Statement, params: list[bytes | None]
) -> list[bytes | None] | None:
    """``run`` for async code."""
    pgconn = conn.pgconn
    session = _session(pgconn)
    done = session.prepared
    for _ in range(2):
        if statement.name not in done:
            pgconn.send_prepare(statement.name, statement.text)
            _job_id_or_ok(await _results(pgconn, session))
            done.add(statement.name)
        pgconn.send_query_prepared(statement.name, params)
        try:
            return _row(await _results(pgconn, session))
        except errors.InvalidSqlStatementName:  # deallocated by code that borrowed the conn
            done.discard(statement.name)
    raise psycopg.InterfaceError("the job INSERT could not be prepared")


def _job_id_or_ok(results: list[Any]) -> None:
    for result in results:
        if result.status == ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(result, encoding="utf-8")


async def _results(pgconn: Any, session: _Session) -> list[Any]:
    """Every result of the query just sent, without blocking the loop. A caller cancelled
    meanwhile leaves the connection busy, so the pool closes it (pools._settled)."""
    loop = asyncio.get_running_loop()
    while pgconn.flush():
        await _ready(loop, pgconn.socket, write=True)
    watcher = session.watcher
    if watcher is None or not watcher.attached or watcher.loop is not loop:
        watcher = session.watcher = _Watcher(loop, pgconn.socket) if _WATCH else None
    results: list[Any] = []
    while True:
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)
        if watcher is None:
            await _ready(loop, pgconn.socket, write=False)
            pgconn.consume_input()
        else:
            await watcher.answer(pgconn)


class _Watcher:
    """The loop's reader on a connection's socket, kept from one call to the next.

    Adding and removing a reader around every call cost about a fifth of an async enqueue's
    CPU (docs/performance.md, "Single enqueue"). The reader watches a duplicate of the
    socket, so whoever closes the connection (the pool, ``App.close()`` from another thread,
    libpq after a failed read) never leaves the loop watching a closed descriptor, whose
    number the next socket may reuse. The duplicate is the watcher's own: it is closed in the
    loop's thread, by ``detach``, or when the loop has dropped the watcher (a closed loop).

    Between calls the socket has nothing to say: when it does (the server's goodbye, a closed
    connection, or the answer to a statement run through psycopg by another user of the
    connection) the watcher detaches itself without reading, so it never steals another
    reader's data nor spins on a socket left readable, and the next call attaches a new one.
    """

    __slots__ = ("__weakref__", "_close_fd", "attached", "fd", "loop", "pgconn", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, socket: int) -> None:
        self.loop = loop
        self.fd = os.dup(socket)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        self._close_fd.atexit = False
        self.waiter: asyncio.Future[None] | None = None
        self.pgconn: Any = None
        try:
            loop.add_reader(self.fd, self._readable)
        except BaseException:
            self._close_fd()
            raise
        self.attached = True

    async def answer(self, pgconn: Any) -> None:
        """Wait until ``pgconn`` has a result to give (or its connection failed). The input
        is read in the reader's callback, so the loop is not told twice of the same bytes."""
        waiter = self.waiter = self.loop.create_future()
        self.pgconn = pgconn
        try:
            await waiter
        finally:
            self.waiter = self.pgconn = None

    def _readable(self) -> None:
        waiter, pgconn = self.waiter, self.pgconn
        if waiter is None:  # not ours to read (see the class docstring)
            self.detach()
            return
        if waiter.done():  # cancelled; the caller has yet to see it
            return
        try:
            pgconn.consume_input()
        except psycopg.Error as exc:  # the connection is gone: libpq says so to the caller
            self.detach()
            waiter.set_exception(exc)
            return
        if not pgconn.is_busy():
            waiter.set_result(None)

    def detach(self) -> None:
        """Stop watching and close the duplicate (in the loop's thread)."""
        if self.attached:
            self.attached = False
            self.loop.remove_reader(self.fd)
            self._close_fd()


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
