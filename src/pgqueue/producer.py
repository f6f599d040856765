"""Enqueueing: argument checks and row building shared by the sync and async paths.

Everything that can be wrong with a job is found here, before any SQL runs, so a refused job
writes nothing. The I/O twins below are thin on purpose: the logic cannot drift between them.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import psycopg

from . import db
from .errors import InvalidJobError
from .jobs import EARLIEST_RUN_AT, LATEST_RUN_AT, MAX_DELAY_SECONDS, Enqueued
from .sql import Queries
from .unique import UniqueRule, key_for, plain_mapping

MAX_QUEUE_LENGTH = 128
MAX_TASK_LENGTH = 256
_INT32 = 2**31 - 1
DEFAULT_MAX_PAYLOAD = 1024 * 1024
COPY_CHUNK = 500  # rows per COPY write: PostgreSQL ingests one chunk while the next is checked


class JobRow(NamedTuple):
    """A validated job, ready for INSERT or COPY. A named tuple: immutable like a frozen
    dataclass, and made in a quarter of its time (one is made per enqueue)."""

    queue: str
    task: str
    args_json: str
    priority: int
    run_at: datetime | None
    delay: float
    max_attempts: int
    #: Set for a unique job (unique.key_for), with its rule's other three parts.
    unique_key: str | None = None
    unique_while: str | None = None
    unique_for: float | None = None
    on_conflict: str = "keep"
    #: The job's limit group within its task ('' for a limit over the whole task), set when
    #: the task is declared with a limit or a rate (concepts/limits.md). None: the database
    #: decides (a task limited there gets '').
    limit_key: str | None = None
    #: The caller's own data (configure(meta=...)), as JSON text; None: none.
    meta_json: str | None = None
    #: Parent job ids (after=...): the job waits until they finish (concepts/workflows.md).
    after: tuple[int, ...] | None = None
    #: What a failed parent does to it: "cancel" (default) or "run".
    after_failure: str = "cancel"

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "task": self.task,
            "args": self.args_json,
            "priority": self.priority,
            "run_at": self.run_at,
            "delay": self.delay,
            "max_attempts": self.max_attempts,
            "limit_key": self.limit_key,
            "meta": self.meta_json,
        }

    def unique_params(self) -> dict[str, Any]:
        return {
            **self.params(),
            "unique_key": self.unique_key,
            "unique_while": self.unique_while,
            "unique_for": self.unique_for,
            "on_conflict": self.on_conflict,
        }

    def with_args(
        self, args_json: str, unique_key: str | None = None, limit_key: str | None = None
    ) -> JobRow:
        return JobRow(self.queue, self.task, args_json, self.priority, self.run_at, self.delay,
                      self.max_attempts, unique_key, self.unique_while, self.unique_for,
                      self.on_conflict, limit_key, self.meta_json)  # fmt: skip

    def group_key(self, limited: frozenset[str]) -> str | None:
        """The limit group written by a bulk enqueue, which cannot ask the database per row:
        ``limited`` names the tasks with limits there (read with the batch's clock)."""
        if self.limit_key is None and self.task in limited:
            return ""
        return self.limit_key

    def db_run_at(self, db_now: datetime) -> datetime:
        """run_at on the database clock, for rows written without ``now()`` in SQL."""
        if self.run_at is not None:
            return self.run_at
        return db_now + timedelta(seconds=self.delay) if self.delay else db_now

    def copy_line(self, now_text: str, db_now: datetime, limited: frozenset[str]) -> str:
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
        group = self.group_key(limited)
        limit_key = "\\N" if group is None else _key_escape(group)
        meta = "\\N" if self.meta_json is None else self.meta_json.replace("\\", "\\\\")
        if self.unique_key is None:
            return (
                f"{_copy_escape(self.queue)}\t{_copy_escape(self.task)}\t{args}\t"
                f"{self.priority}\t{run_at}\t{self.max_attempts}\t\\N\t\\N\t\\N\t"
                f"{limit_key}\t{meta}\n"
            )
        unique_for = "\\N" if self.unique_for is None else repr(self.unique_for)
        return (
            f"{_copy_escape(self.queue)}\t{_copy_escape(self.task)}\t{args}\t"
            f"{self.priority}\t{run_at}\t{self.max_attempts}\t{_key_escape(self.unique_key)}\t"
            f"{self.unique_while}\t{unique_for}\t{limit_key}\t{meta}\n"
        )


class BatchClock(NamedTuple):
    """What a bulk enqueue reads from the database before it writes: the time its rows' run_at
    counts from, and the tasks limited there (their jobs need a limit group; see JobRow)."""

    now: datetime
    limited: frozenset[str]


def _key_escape(key: str) -> str:
    """A unique key as a COPY text field (keys rarely repeat: not cached)."""
    if "\\" in key or "\t" in key or "\n" in key or "\r" in key:
        return (
            key.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
        )
    return key


@functools.lru_cache(maxsize=1024)
def _copy_escape(name: str) -> str:
    """A queue or task name as a COPY text field (names repeat: each is escaped once)."""
    return name.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


# One encoder for every job (json.dumps with options builds a new one per call).
_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=plain_mapping
)


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


def _exact_json(value: Any) -> str:
    """JSON text like ``_ENCODER``'s, with floats written by ``_float_text``. The C encoder takes
    no float formatter, so the rare arguments holding a float of 1e16 or more are written by
    this walk, with public API only (values were checked by ``_check_value`` first)."""
    if isinstance(value, str):
        return _ENCODER.encode(value)
    if value is None or isinstance(value, bool):
        return "null" if value is None else ("true" if value else "false")
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, Mapping):
        items = (f"{_ENCODER.encode(k)}:{_exact_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    return "[" + ",".join(_exact_json(item) for item in value) + "]"


#: Argument values whose JSON text says all a check needs to know (see ``_flat_json``).
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _flat_json(args: dict[Any, Any], max_payload: int) -> str | None:
    """The JSON text of arguments that are all plain scalars under identifier names, when it
    holds nothing ``_check_value`` would refuse (None: ask it). Most jobs' arguments are, and
    their text shows what the walk looks for: NaN and infinities fail the encoder, a NUL is
    written ``\\u0000``, a lone surrogate fails the UTF-8 encoding that measures the size."""
    for key, value in args.items():
        if type(key) is not str or type(value) not in _SCALARS or not key.isidentifier():
            return None
    try:
        text = _ENCODER.encode(args)
        size = len(text.encode("utf-8"))
    except (ValueError, UnicodeEncodeError):
        return None
    if size > max_payload or "\\u0000" in text or "e+" in text:
        return None
    return text


def serialize_args(args: Mapping[str, Any] | None, max_payload: int) -> str:
    if args is None:
        args = {}
    if type(args) is dict and (text := _flat_json(args, max_payload)) is not None:
        return text
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
            text = _exact_json(args)
    except ValueError as exc:  # e.g. an int beyond Python's int-to-str digit limit
        raise InvalidJobError(f"arguments are not JSON-serialisable: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > max_payload:
        raise InvalidJobError(
            f"arguments are {size:,} bytes as JSON; the limit is {max_payload:,} bytes "
            "(store large data elsewhere and pass a reference)"
        )
    return text


def serialize_meta(meta: Mapping[str, Any], max_payload: int) -> str:
    """A job's ``meta`` as JSON text: a mapping of JSON values, like the arguments, bounded by
    the same size (it travels with the job to the handler and the dashboard)."""
    if not isinstance(meta, Mapping):
        raise InvalidJobError(f"meta must be a mapping, got {type(meta).__name__}")
    for key, value in meta.items():
        if not isinstance(key, str):
            raise InvalidJobError(f"meta keys must be strings, got {key!r}")
        _check_value(value, f"meta[{key!r}]")
    try:
        text = _ENCODER.encode(meta)
    except ValueError as exc:
        raise InvalidJobError(f"meta is not JSON-serialisable: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > max_payload:
        raise InvalidJobError(f"meta is {size:,} bytes as JSON; the limit is {max_payload:,}")
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
    unique: tuple[UniqueRule, str | None] | None = None,
    limit_key: str | None = None,
    meta: Mapping[str, Any] | None = None,
) -> JobRow:
    """``unique``: the job's rule and the caller's explicit key, if it is a unique job.
    ``limit_key``: its limit group, if its task declares a limit (see JobRow)."""
    seconds, when = check_delay(delay, run_at)
    task = check_name("task", task, MAX_TASK_LENGTH)
    args_json = serialize_args(args, max_payload)
    row = JobRow(
        queue=check_name("queue", queue, MAX_QUEUE_LENGTH),
        task=task,
        args_json=args_json,
        priority=check_int("priority", priority, -_INT32),
        run_at=when,
        delay=seconds,
        max_attempts=check_int("max_attempts", max_attempts, 1),
        limit_key=limit_key,
        meta_json=None if meta is None else serialize_meta(meta, max_payload),
    )
    if unique is None:
        return row
    rule, explicit = unique
    return with_unique(row, rule, key_for(task, rule, args or {}, explicit, args_json))


def with_unique(row: JobRow, rule: UniqueRule, key: str) -> JobRow:
    return JobRow(row.queue, row.task, row.args_json, row.priority, row.run_at, row.delay,
                  row.max_attempts, key, rule.while_, rule.for_, rule.on_conflict,
                  row.limit_key, row.meta_json)  # fmt: skip


# --- I/O: sync and async twins ------------------------------------------------------------


#: insert_unique_job answers nothing when the job holding the key no longer holds it: its key is
#: released and the insert runs again. More misses than this in a row can only mean a
#: REPEATABLE READ (or SERIALIZABLE) caller's transaction, whose snapshot never moves.
UNIQUE_TRIES = 5


def _no_answer_text(key: str) -> str:
    return (
        f"unique key {key!r}: the job holding it kept finishing under this transaction's "
        "snapshot; enqueue unique jobs in a READ COMMITTED transaction"
    )


def no_answer(row: JobRow) -> InvalidJobError:
    return InvalidJobError(_no_answer_text(str(row.unique_key)))


def _child(row: JobRow, record: tuple[Any, ...] | None) -> Enqueued:
    if record is None:
        raise InvalidJobError(f"after={list(row.after or ())}: some parent job does not exist")
    return Enqueued(record[0])


def insert(conn: psycopg.Connection[Any], q: Queries, row: JobRow) -> Enqueued:
    if row.after is not None:
        params = {**row.params(), "after": list(row.after), "after_failure": row.after_failure}
        return _child(row, conn.execute(q.insert_child_job, params).fetchone())
    if row.unique_key is None:
        record = conn.execute(q.insert_job, row.params()).fetchone()
        assert record is not None
        return Enqueued(record[0])
    params = row.unique_params()

    def attempt() -> Enqueued | None:
        record = conn.execute(q.insert_unique_job, params).fetchone()
        return None if record is None else Enqueued(record[0], record[1], record[2])

    return insert_unique(conn, q, row, attempt)


def insert_unique(
    conn: psycopg.Connection[Any], q: Queries, row: JobRow, attempt: Callable[[], Enqueued | None]
) -> Enqueued:
    """A unique job, whatever sends its statement (psycopg here, ``wire`` on the app's own
    connections): ``attempt`` runs insert_unique_job once; no answer means the job holding the
    key no longer holds it, so the key is released and the insert runs again."""
    for _ in range(UNIQUE_TRIES):
        if (job := attempt()) is not None:
            return job
        conn.execute(q.release_unique_keys, {"keys": [row.unique_key]})
    raise no_answer(row)


async def insert_unique_async(
    conn: psycopg.AsyncConnection[Any],
    q: Queries,
    row: JobRow,
    attempt: Callable[[], Awaitable[Enqueued | None]],
) -> Enqueued:
    """``insert_unique`` for async code."""
    for _ in range(UNIQUE_TRIES):
        if (job := await attempt()) is not None:
            return job
        await conn.execute(q.release_unique_keys, {"keys": [row.unique_key]})
    raise no_answer(row)


async def insert_async(conn: psycopg.AsyncConnection[Any], q: Queries, row: JobRow) -> Enqueued:
    if row.after is not None:
        params = {**row.params(), "after": list(row.after), "after_failure": row.after_failure}
        cursor = await conn.execute(q.insert_child_job, params)
        return _child(row, await cursor.fetchone())
    if row.unique_key is None:
        cursor = await conn.execute(q.insert_job, row.params())
        record = await cursor.fetchone()
        assert record is not None
        return Enqueued(record[0])
    params = row.unique_params()

    async def attempt() -> Enqueued | None:
        cursor = await conn.execute(q.insert_unique_job, params)
        record = await cursor.fetchone()
        return None if record is None else Enqueued(record[0], record[1], record[2])

    return await insert_unique_async(conn, q, row, attempt)


def _copy_text(rows: Sequence[JobRow], clock: BatchClock) -> str:
    """COPY text for a chunk of rows. Text COPY of pre-formatted lines costs a fraction of
    binary ``write_row`` per row, which formats each field in Python."""
    db_now, limited = clock
    now_text = db_now.isoformat()
    return "".join(row.copy_line(now_text, db_now, limited) for row in rows)


# The chunks are checked lazily, inside the COPY: PostgreSQL ingests one chunk while Python checks
# and formats the next (checking costs about half of what the server spends per row, so the two
# overlap instead of adding up). A job refused halfway aborts the COPY; the transaction (or, in
# the caller's transaction, the savepoint) around it rolls back, so nothing of the batch is
# written and the caller's own transaction stays usable. A COPY cannot say ON CONFLICT: a chunk
# holding unique jobs is written by insert_unique_jobs instead, and consecutive chunks without
# any share one COPY, so a batch without unique jobs is one COPY as before.

_UNIQUE_ARRAYS = ("queues", "tasks", "args", "priorities", "run_ats", "max_attempts", "keys",
                  "whiles", "fors", "limit_keys", "metas")  # fmt: skip


def _has_unique(rows: Sequence[JobRow]) -> bool:
    return any(row.unique_key is not None for row in rows)


def unique_groups(rows: Sequence[JobRow], clock: BatchClock) -> list[tuple[str, list[list[Any]]]]:
    """A chunk as insert_unique_jobs rows, one group per on_conflict, repeats of a key merged
    into its first row (a statement cannot update one row twice). A repeat counts as a
    duplicate of the first; with replace or debounce the first takes its arguments
    and priority, and with debounce the later of the two run_at values, as if enqueued in turn."""
    db_now, limited = clock
    groups: dict[str, list[list[Any]]] = {}
    seen: dict[tuple[str, str], list[Any]] = {}
    for row in rows:
        entry = [row.queue, row.task, row.args_json, row.priority, row.db_run_at(db_now),
                 row.max_attempts, row.unique_key, row.unique_while, row.unique_for,
                 row.group_key(limited), row.meta_json]  # fmt: skip
        key = row.unique_key
        if key is not None:
            first = seen.get((row.on_conflict, key))
            if first is not None:
                if row.on_conflict != "keep":
                    first[2], first[3] = entry[2], entry[3]
                    if row.on_conflict == "debounce":
                        first[4] = max(first[4], entry[4])
                continue
            seen[(row.on_conflict, key)] = entry
        groups.setdefault(row.on_conflict, []).append(entry)
    return list(groups.items())


def _group_params(mode: str, entries: list[list[Any]]) -> dict[str, Any]:
    columns = list(zip(*entries, strict=True))
    return {
        "on_conflict": mode,
        **{name: list(col) for name, col in zip(_UNIQUE_ARRAYS, columns, strict=True)},
    }


def _unanswered(entries: list[list[Any]], answers: list[tuple[Any, ...]]) -> list[list[Any]]:
    answered = {key for key, _ in answers if key is not None}
    return [e for e in entries if e[6] is not None and e[6] not in answered]


#: Unique chunks sent in one pipeline before their answers are read.
PIPELINE_CHUNKS = 20


def _insert_until_answered(
    cur: psycopg.Cursor[Any], q: Queries, mode: str, entries: list[list[Any]]
) -> int:
    """Rows whose key a job that no longer holds it still carried: release, insert again."""
    written = 0
    for _ in range(UNIQUE_TRIES):
        cur.execute(q.release_unique_keys, {"keys": [e[6] for e in entries]})
        answers = cur.execute(q.insert_unique_jobs, _group_params(mode, entries)).fetchall()
        written += sum(1 for _, new in answers if new)
        entries = _unanswered(entries, answers)
        if not entries:
            return written
    raise InvalidJobError(_no_answer_text(str(entries[0][6])))


async def _insert_until_answered_async(
    cur: psycopg.AsyncCursor[Any], q: Queries, mode: str, entries: list[list[Any]]
) -> int:
    written = 0
    for _ in range(UNIQUE_TRIES):
        await cur.execute(q.release_unique_keys, {"keys": [e[6] for e in entries]})
        await cur.execute(q.insert_unique_jobs, _group_params(mode, entries))
        answers = await cur.fetchall()
        written += sum(1 for _, new in answers if new)
        entries = _unanswered(entries, answers)
        if not entries:
            return written
    raise InvalidJobError(_no_answer_text(str(entries[0][6])))


def insert_unique_chunks(
    conn: psycopg.Connection[Any],
    q: Queries,
    rows: Sequence[JobRow],
    chunks: Iterator[Sequence[JobRow]],
    clock: BatchClock,
) -> tuple[int, Sequence[JobRow] | None]:
    """Writes ``rows`` and the chunks after it that hold unique jobs, in a pipeline: PostgreSQL
    inserts one chunk while Python checks the next, as with COPY. Returns the new jobs written
    and the next chunk (one without unique jobs, or None at the end)."""
    written = 0
    next_rows: Sequence[JobRow] | None = rows
    while next_rows is not None and _has_unique(next_rows):
        sent: list[tuple[psycopg.Cursor[Any], str, list[list[Any]]]] = []
        with conn.pipeline():
            for _ in range(PIPELINE_CHUNKS):
                groups = unique_groups(next_rows, clock)
                for mode, entries in groups:
                    cur = conn.cursor()
                    cur.execute(q.insert_unique_jobs, _group_params(mode, entries))
                    sent.append((cur, mode, entries))
                next_rows = next(chunks, None)
                if next_rows is None or not _has_unique(next_rows):
                    break
        with conn.cursor() as again:
            for cur, mode, entries in sent:
                answers = cur.fetchall()
                cur.close()
                written += sum(1 for _, new in answers if new)
                left = _unanswered(entries, answers)
                if left:
                    written += _insert_until_answered(again, q, mode, left)
    return written, next_rows


async def insert_unique_chunks_async(
    conn: psycopg.AsyncConnection[Any],
    q: Queries,
    rows: Sequence[JobRow],
    chunks: Iterator[Sequence[JobRow]],
    clock: BatchClock,
) -> tuple[int, Sequence[JobRow] | None]:
    written = 0
    next_rows: Sequence[JobRow] | None = rows
    while next_rows is not None and _has_unique(next_rows):
        sent: list[tuple[psycopg.AsyncCursor[Any], str, list[list[Any]]]] = []
        async with conn.pipeline():
            for _ in range(PIPELINE_CHUNKS):
                groups = unique_groups(next_rows, clock)
                for mode, entries in groups:
                    cur = conn.cursor()
                    await cur.execute(q.insert_unique_jobs, _group_params(mode, entries))
                    sent.append((cur, mode, entries))
                next_rows = next(chunks, None)
                if next_rows is None or not _has_unique(next_rows):
                    break
        async with conn.cursor() as again:
            for cur, mode, entries in sent:
                answers = await cur.fetchall()
                await cur.close()
                written += sum(1 for _, new in answers if new)
                left = _unanswered(entries, answers)
                if left:
                    written += await _insert_until_answered_async(again, q, mode, left)
    return written, next_rows


class _RepeatedKey(Exception):
    """A chunk repeats a key: its jobs cannot all be copied."""


def _repeats_a_key(rows: Sequence[JobRow]) -> bool:
    keys = [row.unique_key for row in rows if row.unique_key is not None]
    return len(set(keys)) < len(keys)


def _is_key_conflict(exc: psycopg.errors.UniqueViolation) -> bool:
    return exc.diag.constraint_name == "pgqueue_jobs_unique_idx"


def _mixed(
    conn: psycopg.Connection[Any],
    cur: psycopg.Cursor[Any],
    q: Queries,
    it: Iterator[Sequence[JobRow]],
    clock: BatchClock,
) -> int:
    """Chunks with unique jobs through insert_unique_jobs, runs of others through one COPY."""
    count = 0
    rows = next(it, None)
    while rows is not None:
        if _has_unique(rows):
            written, rows = insert_unique_chunks(conn, q, rows, it, clock)
            count += written
            continue
        with cur.copy(q.copy_jobs) as copy:
            while rows is not None and not _has_unique(rows):
                copy.write(_copy_text(rows, clock))
                count += len(rows)
                rows = next(it, None)
    return count


async def _mixed_async(
    conn: psycopg.AsyncConnection[Any],
    cur: psycopg.AsyncCursor[Any],
    q: Queries,
    it: Iterator[Sequence[JobRow]],
    clock: BatchClock,
) -> int:
    count = 0
    rows = next(it, None)
    while rows is not None:
        if _has_unique(rows):
            written, rows = await insert_unique_chunks_async(conn, q, rows, it, clock)
            count += written
            continue
        async with cur.copy(q.copy_jobs) as copy:
            while rows is not None and not _has_unique(rows):
                await copy.write(_copy_text(rows, clock))
                count += len(rows)
                rows = next(it, None)
    return count


def _batch_clock(row: tuple[Any, ...] | None) -> BatchClock:
    assert row is not None
    return BatchClock(row[0], frozenset(row[1]))


def bound_client_waits(conn: psycopg.Connection[Any], q: Queries) -> tuple[Any, ...]:
    """First in a transaction of pgqueue's own that the server waits in for its client
    (mid-COPY, between statements): the server drops a vanished client within seconds
    (database_now_bounded). Its row: the database clock and the tasks limited in the database,
    as database_now's."""
    row = conn.execute(q.database_now_bounded, db.SERVER_KEEPALIVES).fetchone()
    assert row is not None
    return tuple(row)


def copy_rows(
    conn: psycopg.Connection[Any],
    q: Queries,
    chunks: Iterable[Sequence[JobRow]],
    *,
    own: bool = False,
) -> int:
    """The jobs written as new (duplicates of unique jobs are not counted). Chunks before the
    first unique job: one COPY. From there on: one COPY in a savepoint, kept if every key was
    new; on a key some job already has, those chunks are written again with ON CONFLICT.
    ``own``: the transaction is pgqueue's, so it bounds the server's wait for this client
    (database_now_bounded); a caller's transaction is left as the caller set it."""
    count = 0
    with conn.cursor() as cur:
        if not own:
            clock = _batch_clock(cur.execute(q.database_now).fetchone())
        with conn.transaction():
            if own:
                clock = _batch_clock(bound_client_waits(conn, q))
            it = iter(chunks)
            rows = next(it, None)
            if rows is not None and not _has_unique(rows):
                with cur.copy(q.copy_jobs) as copy:
                    while rows is not None and not _has_unique(rows):
                        copy.write(_copy_text(rows, clock))
                        count += len(rows)
                        rows = next(it, None)
            if rows is None:
                return count
            seen: list[Sequence[JobRow]] = []
            try:
                with conn.transaction(), cur.copy(q.copy_jobs) as copy:
                    while rows is not None:
                        seen.append(rows)
                        if _repeats_a_key(rows):
                            raise _RepeatedKey
                        copy.write(_copy_text(rows, clock))
                        rows = next(it, None)
                return count + sum(len(r) for r in seen)
            except psycopg.errors.UniqueViolation as exc:
                if not _is_key_conflict(exc):
                    raise
            except _RepeatedKey:
                pass
            return count + _mixed(conn, cur, q, itertools.chain(seen, it), clock)


async def copy_rows_async(
    conn: psycopg.AsyncConnection[Any],
    q: Queries,
    chunks: Iterable[Sequence[JobRow]],
    *,
    own: bool = False,
) -> int:
    count = 0
    async with conn.cursor() as cur:
        if not own:
            await cur.execute(q.database_now)
            clock = _batch_clock(await cur.fetchone())
        async with conn.transaction():
            if own:
                await cur.execute(q.database_now_bounded, db.SERVER_KEEPALIVES)
                clock = _batch_clock(await cur.fetchone())
            it = iter(chunks)
            rows = next(it, None)
            if rows is not None and not _has_unique(rows):
                async with cur.copy(q.copy_jobs) as copy:
                    while rows is not None and not _has_unique(rows):
                        await copy.write(_copy_text(rows, clock))
                        count += len(rows)
                        rows = next(it, None)
            if rows is None:
                return count
            seen: list[Sequence[JobRow]] = []
            try:
                async with conn.transaction(), cur.copy(q.copy_jobs) as copy:
                    while rows is not None:
                        seen.append(rows)
                        if _repeats_a_key(rows):
                            raise _RepeatedKey
                        await copy.write(_copy_text(rows, clock))
                        rows = next(it, None)
                return count + sum(len(r) for r in seen)
            except psycopg.errors.UniqueViolation as exc:
                if not _is_key_conflict(exc):
                    raise
            except _RepeatedKey:
                pass
            return count + await _mixed_async(conn, cur, q, itertools.chain(seen, it), clock)
