"""Task declarations: what ``@app.task`` returns, and per-call options via ``configure``."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    get_origin,
    get_type_hints,
    overload,
)

import psycopg

from . import connections, producer, workflows
from .backoff import Backoff
from .context import JobContext
from .errors import ConfigurationError, InvalidJobError
from .jobs import Enqueued
from .limits import TaskLimits
from .unique import OnConflict, UniqueBy, UniqueRule, UniqueWhile, combine

if TYPE_CHECKING:
    from .app import App

P = ParamSpec("P")
Q = ParamSpec("Q")
R = TypeVar("R")

#: What ``configure(connection=)`` takes: a psycopg connection or a SQLAlchemy one on it.
Connection = connections.SyncConnection | connections.AsyncConnection
SyncConnection = psycopg.Connection[Any]
AsyncConnection = psycopg.AsyncConnection[Any]


# Typed enqueue (docs/reference/api.md#typed-enqueue): ``enqueue`` takes the handler's parameters
# minus those the worker fills, when they lead: a JobContext, then a psycopg connection. Each
# protocol below matches a task whose handler starts that way, and leaves the rest (Q) to the
# caller. They are matched through ``func``'s type, as a function is matched to a parameter:
# strictly (``self: Task[Concatenate[JobContext, Q], R]`` is matched loosely by both mypy and
# pyright, and a handler starting with a ``str`` would lose it). A handler whose first parameter
# is untyped or ``Any`` matches them too, but then also the plain signature: nothing it accepts
# is refused.
class _TakesContextAndAsyncConnection(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[JobContext, AsyncConnection, Q], Any]: ...


class _TakesContextAndConnection(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[JobContext, SyncConnection, Q], Any]: ...


class _TakesContext(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[JobContext, Q], Any]: ...


class _TakesAsyncConnection(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[AsyncConnection, Q], Any]: ...


class _TakesConnection(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[SyncConnection, Q], Any]: ...


# A callback (a step of a chain, a group's ``then``, a job with ``after=``) may leave out the
# ``results`` the worker fills: when it leads (after a JobContext) and takes a list. Any handler
# whose first parameter takes a list may then leave it out of ``s()`` and ``configure()``'s
# enqueue: not caught by the type checker, still refused at enqueue unless it is a callback's.
class _TakesResults(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[list[Any], Q], Any]: ...


class _TakesContextAndResults(Protocol[Q]):
    @property
    def func(self) -> Callable[Concatenate[JobContext, list[Any], Q], Any]: ...


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    try:
        hints = get_type_hints(func)
    except Exception:  # unresolvable annotations: fall back to the raw ones
        hints = dict(getattr(func, "__annotations__", {}))
    hints.pop("return", None)
    return hints


def context_parameter(func: Callable[..., Any]) -> str | None:
    """The name of the parameter annotated ``JobContext``, if the handler asks for one."""
    for name, hint in _hints(func).items():
        if hint is JobContext or hint == "JobContext":
            return name
    return None


_CONNECTION_NAME = re.compile(r"^(psycopg\.)?(Async)?Connection(\[.*\])?$")


def connection_parameter(func: Callable[..., Any], is_async: bool) -> str | None:
    """The name of the parameter annotated with a psycopg connection, if the handler asks for
    one: transactional completion. An async handler needs ``psycopg.AsyncConnection``, a sync
    one ``psycopg.Connection``, since the connection is used where the handler runs."""
    for name, hint in _hints(func).items():
        if isinstance(hint, str):
            match = _CONNECTION_NAME.match(hint.strip())
            if not match:
                continue
            wants_async = match.group(2) is not None
        else:
            origin = get_origin(hint) or hint
            if origin not in (psycopg.Connection, psycopg.AsyncConnection):
                continue
            wants_async = origin is psycopg.AsyncConnection
        if wants_async != is_async:
            expected = "psycopg.AsyncConnection" if is_async else "psycopg.Connection"
            kind = "an async" if is_async else "a sync"
            raise ConfigurationError(
                f"{func.__name__}: {kind} handler's transaction parameter {name!r} must be "
                f"annotated {expected}"
            )
        return name
    return None


@dataclass(frozen=True, slots=True)
class TaskOptions:
    queue: str
    priority: int = 0
    max_attempts: int = 5
    delay: float | timedelta | None = None
    run_at: datetime | None = None
    connection: Connection | None = None
    unique: UniqueRule | None = None
    #: The caller's own key for one call (configure(unique_key=...)).
    unique_key: str | None = None
    #: The caller's own data for the job (configure(meta=...)).
    meta: Mapping[str, Any] | None = None
    #: Parents: the job waits until they finish (configure(after=...)).
    after: tuple[int, ...] | None = None
    after_failure: str = "cancel"


def _keyword_rules(
    signature: inspect.Signature, filled: set[str | None]
) -> tuple[frozenset[str], frozenset[str], bool] | None:
    """For arguments given by keyword only: the names a call may give, those it must, and
    whether any other name goes to a ``**kwargs``. None when a positional-only parameter
    without a default makes every keyword call fail (bind says how)."""
    names, required, open_ended = set(), set(), False
    for p in signature.parameters.values():
        if p.name in filled:
            continue
        if p.kind is p.VAR_KEYWORD:
            open_ended = True
        elif p.kind is p.POSITIONAL_ONLY:
            if p.default is p.empty:
                return None
        elif p.kind is not p.VAR_POSITIONAL:
            names.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
    return frozenset(names), frozenset(required), open_ended


class Task(Generic[P, R]):
    """A registered handler. ``enqueue`` takes the handler's keyword arguments (checked against
    its signature at enqueue time, minus the ``JobContext`` and connection parameters, which
    the worker fills; mypy and pyright check them too when those lead the handler's
    parameters). Calling the task runs the handler in-process."""

    def __init__(
        self,
        app: App,
        func: Callable[P, R],
        *,
        name: str,
        options: TaskOptions,
        timeout: float | None,
        backoff: Backoff | None,
        limits: TaskLimits | None = None,
    ) -> None:
        self.app = app
        #: The declared limit, rate and limit key (concepts/limits.md), or None.
        self.limits = limits
        self.func = func
        self.name = name
        self.options = options
        self.timeout = timeout
        self.backoff = backoff
        self.is_async = inspect.iscoroutinefunction(func)
        self.context_param = context_parameter(func)
        #: Set when the handler takes a psycopg connection: its writes commit with the ack.
        self.connection_param = connection_parameter(func, self.is_async)
        self.signature = inspect.signature(func)
        #: A parameter named ``results``: as a callback (app.group(then=...), a chain step) it
        #: receives its parents' results, unless the job's own arguments give it.
        self.wants_results = "results" in self.signature.parameters
        self._by_keyword = _keyword_rules(
            self.signature, {self.context_param, self.connection_param} - {None}
        )
        self.__doc__ = func.__doc__
        self.__wrapped__ = func

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name!r} queue={self.options.queue!r}>"

    def check_args(self, kwargs: dict[str, Any], *, callback: bool = False) -> None:
        """Refuse arguments the handler could never accept, at enqueue time. ``callback``: a
        job that runs after others, whose ``results`` argument the worker fills."""
        if not callback and self._by_keyword is not None:
            # What bind() would find, in two set operations (enqueue's hottest check).
            names, required, open_ended = self._by_keyword
            if required <= kwargs.keys() and (open_ended or kwargs.keys() <= names):
                return
        params = dict(self.signature.parameters)
        if callback and "results" not in kwargs:
            params.pop("results", None)
        for filled_by_worker in (self.context_param, self.connection_param):
            if filled_by_worker:
                params.pop(filled_by_worker, None)
        try:
            self.signature.replace(parameters=list(params.values())).bind(**kwargs)
        except TypeError as exc:
            raise InvalidJobError(f"arguments do not match task {self.name!r}: {exc}") from None

    def configure(
        self,
        *,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        connection: Connection | None = None,
        unique: UniqueBy | None = None,
        unique_key: str | None = None,
        unique_while: UniqueWhile | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: OnConflict | None = None,
        meta: Mapping[str, Any] | None = None,
        after: Iterable[int] | None = None,
        after_failure: str | None = None,
    ) -> ConfiguredTask[P]:
        """Per-call options; ``connection`` enqueues inside the caller's own transaction (a
        psycopg connection, or a SQLAlchemy session or connection on the psycopg driver);
        ``unique_key`` (and the other ``unique`` options) make this call's job unique, or change
        the task's rule; ``meta`` is data of your own (trace ids, a tenant) that the handler
        reads as ``ctx.meta`` and ``get_job`` and the dashboard show. They are checked here, so
        a bad one is refused where it is written."""
        producer.check_delay(delay, run_at)
        rule, key = combine(
            self.options.unique,
            unique=unique,
            unique_key=unique_key if unique_key is not None else self.options.unique_key,
            unique_while=unique_while,
            unique_for=unique_for,
            on_conflict=on_conflict,
        )
        if queue is not None:
            producer.check_name("queue", queue, producer.MAX_QUEUE_LENGTH)
        if priority is not None:
            producer.check_int("priority", priority, -(2**31 - 1))
        if max_attempts is not None:
            producer.check_int("max_attempts", max_attempts, 1)
        if meta is not None:
            producer.serialize_meta(meta, self.app.max_payload_bytes)
        parents = None if after is None else workflows.check_parents(after)
        if after_failure is not None:
            workflows.check_after_failure(after_failure)
        changes: dict[str, Any] = {
            k: v
            for k, v in {
                "queue": queue,
                "priority": priority,
                "max_attempts": max_attempts,
                "delay": delay,
                "run_at": run_at,
                "connection": connection,
                "meta": meta,
                "after": parents,
                "after_failure": after_failure,
            }.items()
            if v is not None
        }
        changes["unique"], changes["unique_key"] = rule, key
        return ConfiguredTask(self, replace(self.options, **changes))

    @overload
    def enqueue(
        self: _TakesContextAndAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    def enqueue(
        self: _TakesContextAndConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesContext[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesConnection[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued: ...

    def enqueue(self, *args: Any, **kwargs: Any) -> Enqueued:
        """Queue a job with the handler's arguments, by keyword (checked by mypy and pyright
        against the handler's signature, without the parameters the worker fills)."""
        return ConfiguredTask(self, self.options).enqueue(*args, **kwargs)

    @overload
    def s(
        self: _TakesContextAndAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> workflows.Signature: ...

    @overload
    def s(
        self: _TakesContextAndConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> workflows.Signature: ...

    @overload
    def s(self: _TakesContext[Q], *args: Q.args, **kwargs: Q.kwargs) -> workflows.Signature: ...

    @overload
    def s(
        self: _TakesAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> workflows.Signature: ...

    @overload
    def s(self: _TakesConnection[Q], *args: Q.args, **kwargs: Q.kwargs) -> workflows.Signature: ...

    @overload
    def s(
        self: _TakesContextAndResults[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> workflows.Signature: ...

    @overload
    def s(self: _TakesResults[Q], *args: Q.args, **kwargs: Q.kwargs) -> workflows.Signature: ...

    @overload
    def s(self, *args: P.args, **kwargs: P.kwargs) -> workflows.Signature: ...

    def s(self, *args: Any, **kwargs: Any) -> workflows.Signature:
        """This task with these arguments, not enqueued yet: a step of ``app.chain`` or a member
        (or callback) of ``app.group``."""
        if args:
            raise InvalidJobError("pass task arguments by keyword: they are stored as JSON by name")
        return workflows.Signature(self, kwargs)

    @overload
    async def enqueue_async(
        self: _TakesContextAndAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesContextAndConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesContext[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued: ...

    async def enqueue_async(self, *args: Any, **kwargs: Any) -> Enqueued:
        return await ConfiguredTask(self, self.options).enqueue_async(*args, **kwargs)


class ConfiguredTask(Generic[P]):
    def __init__(self, task: Task[P, Any], options: TaskOptions) -> None:
        self.task = task
        self.options = options

    @property
    def func(self) -> Callable[P, Any]:
        """The task's handler: what typed enqueue matches (see the protocols above)."""
        return self.task.func

    def _kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if args:
            raise InvalidJobError("pass task arguments by keyword: they are stored as JSON by name")
        self.task.check_args(kwargs, callback=self.options.after is not None)
        return kwargs

    @overload
    def enqueue(
        self: _TakesContextAndAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    def enqueue(
        self: _TakesContextAndConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesContext[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesConnection[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(
        self: _TakesContextAndResults[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    def enqueue(self: _TakesResults[Q], *args: Q.args, **kwargs: Q.kwargs) -> Enqueued: ...

    @overload
    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued: ...

    def enqueue(self, *args: Any, **kwargs: Any) -> Enqueued:
        o = self.options
        conn = None if o.connection is None else connections.sync_connection(o.connection)
        return self.task.app.enqueue(
            self.task.name,
            self._kwargs(args, kwargs),
            queue=o.queue,
            priority=o.priority,
            max_attempts=o.max_attempts,
            delay=o.delay,
            run_at=o.run_at,
            connection=conn,
            meta=o.meta,
            after=o.after,
            after_failure=o.after_failure,
            **_unique_options(self.task, o),
        )

    @overload
    async def enqueue_async(
        self: _TakesContextAndAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesContextAndConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesContext[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesAsyncConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesConnection[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesContextAndResults[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(
        self: _TakesResults[Q], *args: Q.args, **kwargs: Q.kwargs
    ) -> Enqueued: ...

    @overload
    async def enqueue_async(self, *args: P.args, **kwargs: P.kwargs) -> Enqueued: ...

    async def enqueue_async(self, *args: Any, **kwargs: Any) -> Enqueued:
        o = self.options
        conn = None if o.connection is None else await connections.async_connection(o.connection)
        return await self.task.app.enqueue_async(
            self.task.name,
            self._kwargs(args, kwargs),
            queue=o.queue,
            priority=o.priority,
            max_attempts=o.max_attempts,
            delay=o.delay,
            run_at=o.run_at,
            connection=conn,
            meta=o.meta,
            after=o.after,
            after_failure=o.after_failure,
            **_unique_options(self.task, o),
        )


def _unique_options(task: Task[Any, Any], options: TaskOptions) -> dict[str, Any]:
    """A configured call's unique rule, as app.enqueue's options (which start from the task's
    rule again: say every part, or turn it off)."""
    rule = options.unique
    if rule is None:
        return {"unique": False} if task.options.unique is not None else {}
    return {
        "unique": rule.by,
        "unique_key": options.unique_key,
        "unique_while": rule.while_,
        "unique_for": rule.for_,
        "on_conflict": rule.on_conflict,
    }
