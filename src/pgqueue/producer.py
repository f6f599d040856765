"""Enqueueing: argument checks and row building shared by the sync and async paths.

Everything that can be wrong with a job is found here, before any SQL runs, so a refused job
writes nothing. The I/O twins below are thin on purpose: the logic cannot drift between them.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from json.encoder import _make_iterencode  # type: ignore[attr-defined]
from typing import Any

import psycopg

from .errors import InvalidJobError
from .jobs import EARLIEST_RUN_AT, LATEST_RUN_AT, MAX_DELAY_SECONDS
from .sql import Queries

MAX_QUEUE_LENGTH = 128
MAX_TASK_LENGTH = 256
_INT32 = 2**31 - 1
DEFAULT_MAX_PAYLOAD = 1024 * 1024
COPY_CHUNK = 500  # rows per COPY write: PostgreSQL ingests one chunk while the next is checked


@dataclass(frozen=True, slots=True)
class JobRow:
    """A validated job, ready for INSERT or COPY."""

    queue: str
    task: str
    args_json: str
    priority: int
    run_at: datetime | None
    delay: float
    max_attempts: int

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "task": self.task,
            "args": self.args_json,
            "priority": self.priority,
            "run_at": self.run_at,
            "delay": self.delay,
            "max_attempts": self.max_attempts,
        }

    def with_args(self, args_json: str) -> JobRow:
        return JobRow(self.queue, self.task, args_json, self.priority, self.run_at, self.delay,
                      self.max_attempts)  # fmt: skip

    def copy_line(self, now_text: str, db_now: datetime) -> str:
        """This row in COPY's text format (tab-separated, backslash-escaped, one line)."""
        if self.run_at is not None:
            run_at = self.run_at.isoformat()
        elif self.delay:
            run_at = (db_now + timedelta(seconds=self.delay)).isoformat()
        else:
            run_at = now_text
        # The JSON encoder escapes every control character, so the only character COPY would
        # read specially in the arguments is the backslash.
        args = self.args_json.replace("\\", "\\\\") if "\\" in self.args_json else self.args_json
        return (
            f"{_copy_escape(self.queue)}\t{_copy_escape(self.task)}\t{args}\t"
            f"{self.priority}\t{run_at}\t{self.max_attempts}\n"
        )


@functools.lru_cache(maxsize=1024)
def _copy_escape(name: str) -> str:
    """A queue or task name as a COPY text field (names repeat: each is escaped once)."""
    return name.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


# One encoder for every job (json.dumps with options builds a new one per call).
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def check_name(kind: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidJobError(f"{kind} name must be a string, got {type(value).__name__}")
    return _checked_name(kind, value, limit)


@functools.lru_cache(maxsize=1024)
def _checked_name(kind: str, value: str, limit: int) -> str:
    """Bulk enqueues repeat a few names many times: each is checked once (errors are not
    cached, so a bad name fails every time)."""
    if not value or not value.strip():
        raise InvalidJobError(f"{kind} name must not be empty")
    if len(value) > limit:
        raise InvalidJobError(f"{kind} name is {len(value)} characters; the limit is {limit}")
    if "\x00" in value:
        raise InvalidJobError(f"{kind} name must not contain NUL (\\u0000)")
    if not _is_utf8(value):
        raise InvalidJobError(f"{kind} name contains a lone surrogate, which is not valid UTF-8")
    if kind == "queue":
        # `pgqueue worker --queues a,b` splits on commas and strips spaces: a queue whose name
        # has either could be filled but never served.
        if "," in value:
            raise InvalidJobError(f"queue name {value!r} must not contain a comma")
        if value != value.strip():
            raise InvalidJobError(f"queue name {value!r} must not start or end with whitespace")
    return value


def _is_utf8(text: str) -> bool:
    """False for strings holding lone surrogates (e.g. from a bad decode): not valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: Deeper arguments are refused: they are almost surely a bug (a cycle unrolled, a tree where
#: a reference was meant), and they would exhaust Python's or PostgreSQL's parser stack.
MAX_NESTING = 100


def _check_value(value: Any, path: str, depth: int = 0) -> None:
    """JSON types only; PostgreSQL's jsonb refuses NUL in strings and NaN/Infinity."""
    if depth > MAX_NESTING:
        raise InvalidJobError(
            f"argument {path.split('.')[0].split('[')[0]} is nested more than {MAX_NESTING} "
            "levels deep"
        )
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobError(f"argument {path} is {value!r}; JSON has no NaN or Infinity")
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidJobError(f"argument {path} contains NUL (\\u0000), which jsonb refuses")
        if not _is_utf8(value):
            raise InvalidJobError(f"argument {path} contains a lone surrogate (not valid UTF-8)")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidJobError(f"argument {path} has a non-string key {key!r}")
            if "\x00" in key:
                raise InvalidJobError(f"argument {path} has a key containing NUL (\\u0000)")
            if not _is_utf8(key):
                raise InvalidJobError(f"argument {path} has a key that is not valid UTF-8")
            _check_value(item, f"{path}.{key}", depth + 1)
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_value(item, f"{path}[{index}]", depth + 1)
        return
    raise InvalidJobError(
        f"argument {path} is a {type(value).__name__}, which is not JSON-serialisable "
        "(use str, int, float, bool, None, list or dict)"
    )


def _float_text(value: float) -> str:
    """Python writes floats of 1e16 and more in exponent form (``1e+16``); jsonb stores them as
    numeric and gives back ``10000000000000000``, which JSON decoding turns into an int. Such
    floats are always integral, so write them exactly with a decimal point instead."""
    text = float.__repr__(value)
    return f"{int(value)}.0" if "e+" in text else text


def _exact_float_encoder(args: Mapping[str, Any]) -> Iterator[str]:
    # The C encoder cannot take a float formatter; the stdlib's pure-Python one can.
    iterencode = _make_iterencode(
        {}, None, json.encoder.encode_basestring, None, _float_text, ":", ",", False, False, True
    )
    result: Iterator[str] = iterencode(args, 0)
    return result


def serialize_args(args: Mapping[str, Any] | None, max_payload: int) -> str:
    if args is None:
        args = {}
    if type(args) is not dict and not isinstance(args, Mapping):  # skip the ABC check for dicts
        raise InvalidJobError(
            f"args must be a mapping of keyword arguments, got {type(args).__name__}"
        )
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidJobError(f"argument name {key!r} is not a valid Python identifier")
        _check_value(value, key)
    try:
        text = _ENCODER.encode(args)
        if "e+" in text:  # rare: maybe a float >= 1e16, which jsonb would turn into an integer
            text = "".join(_exact_float_encoder(args))
    except ValueError as exc:  # e.g. an int beyond Python's int-to-str digit limit
        raise InvalidJobError(f"arguments are not JSON-serialisable: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > max_payload:
        raise InvalidJobError(
            f"arguments are {size:,} bytes as JSON; the limit is {max_payload:,} bytes "
            "(store large data elsewhere and pass a reference)"
        )
    return text


def check_delay(
    delay: float | timedelta | None, run_at: datetime | None
) -> tuple[float, datetime | None]:
    """(delay in seconds, absolute run_at), each within the bounds in ``jobs``."""
    if delay is not None and run_at is not None:
        raise InvalidJobError("give delay or run_at, not both")
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidJobError("run_at must be a datetime")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise InvalidJobError("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
        if not EARLIEST_RUN_AT <= run_at <= LATEST_RUN_AT:
            raise InvalidJobError(
                f"run_at must be between {EARLIEST_RUN_AT:%Y-%m-%d} and {LATEST_RUN_AT:%Y-%m-%d} "
                f"(UTC), got {run_at.isoformat()}"
            )
        return 0.0, run_at
    if delay is None:
        return 0.0, None
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidJobError(f"delay must be seconds or a timedelta, got {type(delay).__name__}")
    # Compared, not converted: an int too big for a float is still just too long.
    if seconds < 0 or (isinstance(seconds, float) and not math.isfinite(seconds)):
        raise InvalidJobError(
            f"delay must be a finite, non-negative number of seconds, got {_shown(seconds)}"
        )
    if seconds > MAX_DELAY_SECONDS:
        raise InvalidJobError(
            f"delay must be at most {MAX_DELAY_SECONDS:,.0f} seconds (100 years), "
            f"got {_shown(seconds)}"
        )
    return float(seconds), None


def _shown(seconds: float) -> str:
    try:
        return f"{seconds:g}"
    except OverflowError:  # an int beyond float's range
        return "more than 1e+308" if seconds > 0 else "less than -1e+308"


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(f"{name} must be an integer, got {type(value).__name__}")
    if not minimum <= value <= _INT32:
        raise InvalidJobError(f"{name} must be between {minimum} and {_INT32}, got {value}")
    return value


def build_row(
    *,
    task: str,
    args: Mapping[str, Any] | None,
    queue: str,
    priority: int,
    max_attempts: int,
    delay: float | timedelta | None,
    run_at: datetime | None,
    max_payload: int,
) -> JobRow:
    seconds, when = check_delay(delay, run_at)
    return JobRow(
        queue=check_name("queue", queue, MAX_QUEUE_LENGTH),
        task=check_name("task", task, MAX_TASK_LENGTH),
        args_json=serialize_args(args, max_payload),
        priority=check_int("priority", priority, -_INT32),
        run_at=when,
        delay=seconds,
        max_attempts=check_int("max_attempts", max_attempts, 1),
    )


# --- I/O: sync and async twins ------------------------------------------------------------


def insert(conn: psycopg.Connection[Any], q: Queries, row: JobRow) -> int:
    record = conn.execute(q.insert_job, row.params()).fetchone()
    assert record is not None
    return int(record[0])


async def insert_async(conn: psycopg.AsyncConnection[Any], q: Queries, row: JobRow) -> int:
    cursor = await conn.execute(q.insert_job, row.params())
    record = await cursor.fetchone()
    assert record is not None
    return int(record[0])


def _copy_text(rows: Sequence[JobRow], db_now: datetime) -> str:
    """COPY text for a chunk of rows. Text COPY of pre-formatted lines costs a fraction of
    binary ``write_row`` per row, which formats each field in Python."""
    now_text = db_now.isoformat()
    return "".join(row.copy_line(now_text, db_now) for row in rows)


# The chunks are checked lazily, inside the COPY: PostgreSQL ingests one chunk while Python checks
# and formats the next (checking costs about half of what the server spends per row, so the two
# overlap instead of adding up). A job refused halfway aborts the COPY; the transaction (or, in
# the caller's transaction, the savepoint) around it rolls back, so nothing of the batch is
# written and the caller's own transaction stays usable.


def copy_rows(conn: psycopg.Connection[Any], q: Queries, chunks: Iterable[Sequence[JobRow]]) -> int:
    count = 0
    with conn.cursor() as cur:
        now_row = cur.execute(q.database_now).fetchone()
        assert now_row is not None
        with conn.transaction(), cur.copy(q.copy_jobs) as copy:
            for rows in chunks:
                copy.write(_copy_text(rows, now_row[0]))
                count += len(rows)
    return count


async def copy_rows_async(
    conn: psycopg.AsyncConnection[Any], q: Queries, chunks: Iterable[Sequence[JobRow]]
) -> int:
    count = 0
    async with conn.cursor() as cur:
        await cur.execute(q.database_now)
        now_row = await cur.fetchone()
        assert now_row is not None
        async with conn.transaction(), cur.copy(q.copy_jobs) as copy:
            for rows in chunks:
                await copy.write(_copy_text(rows, now_row[0]))
                count += len(rows)
    return count
