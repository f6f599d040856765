"""Your code around every job: middleware on the worker side, enqueue hooks on the producer side.

Middleware (``@app.middleware`` or ``App(middleware=[...])``) is an async function
``(ctx, call_next)`` that wraps each attempt, sync handlers included (``call_next`` then runs the
handler in the worker's thread pool, in a copy of the middleware's context variables): for
tracing, metrics, logging context, a tenant's set-up. The first registered is the outermost.

An exception of a middleware never loses a job: one raised after the handler ran is logged and
the handler's outcome stands; one raised before is logged and fails the attempt (it is retried
like any failure: the handler must not run without its set-up). Enqueue hooks
(``@app.on_enqueue``) see each job before it is written, with a ``meta`` dict they may add to (a
trace context for the consumer span); one that raises is logged and the job is written without
its changes.

Around-enqueue hooks (``app.around_enqueue``) wrap each call that writes jobs as a whole
(``enqueue``, ``enqueue_many``, ``chain``, ``group`` and their async twins): a context manager
entered before the first job is built and left after the write, given a ``Publish`` that the call
fills in (the jobs built per task and queue, then the ids written). A tracer's producer span
lives there (see pgqueue.contrib.otel); the enqueue hooks run inside it. Without any, a call
pays one list check.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .context import JobContext
from .errors import ConfigurationError
from .jobs import Enqueued

log = logging.getLogger("pgqueue.hooks")

#: ``async def middleware(ctx, call_next) -> result``
Middleware = Callable[[JobContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: ``def hook(task, args, meta) -> None``; adds to ``meta`` in place.
EnqueueHook = Callable[[str, Mapping[str, Any], dict[str, Any]], None]


@dataclass(slots=True)
class Publish:
    """One call that writes jobs, as an around-enqueue hook sees it: filled in as it goes."""

    #: ``"enqueue"``, ``"enqueue_many"``, ``"chain"`` or ``"group"``.
    operation: str
    #: Jobs built so far, per (task, queue): a batch of a million jobs is a few entries.
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    #: The ids written, in order, once the write returned (None for ``enqueue_many``: its COPY
    #: returns no ids).
    ids: list[int] | None = None
    #: Jobs written as new, once the write returned (duplicates of unique jobs are not).
    written: int | None = None

    def add(self, task: str, queue: str) -> None:
        key = (task, queue)
        self.counts[key] = self.counts.get(key, 0) + 1

    @property
    def jobs(self) -> int:
        return sum(self.counts.values())

    def finish(self, result: object) -> None:
        """Record what the call returned: an Enqueued, a list of them, a Group, or a count."""
        if isinstance(result, Enqueued):
            self.ids, self.written = [result.id], 0 if result.duplicate else 1
        elif isinstance(result, int):
            self.written = result
        else:
            members = result if isinstance(result, list) else [
                *getattr(result, "members", ()), getattr(result, "callback", None),
            ]  # fmt: skip
            ids = [m for m in members if isinstance(m, Enqueued)]
            self.ids, self.written = [m.id for m in ids], sum(1 for m in ids if not m.duplicate)


#: ``def hook(publish) -> context manager``, entered around a call that writes jobs.
AroundEnqueue = Callable[[Publish], AbstractContextManager[object]]

#: The call writing jobs in this context, while around-enqueue hooks are registered.
current_publish: contextvars.ContextVar[Publish | None] = contextvars.ContextVar(
    "pgqueue_current_publish", default=None
)


@contextlib.contextmanager
def publishing(hooks: list[AroundEnqueue], operation: str) -> Iterator[Publish]:
    """Every around-enqueue hook entered (the first outermost), for one call. A hook that
    raises, entering or leaving, is logged and otherwise ignored: once the jobs are written, an
    exception would make the caller enqueue them again."""
    publish = Publish(operation)
    token = current_publish.set(publish)
    try:
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                try:
                    stack.enter_context(_Guarded(hook(publish), hook))
                except Exception:
                    log.exception("around-enqueue hook %s raised; ignored", _name(hook))
            yield publish
    finally:
        current_publish.reset(token)


class _Guarded:
    """A hook's context manager whose exit cannot replace the call's outcome."""

    def __init__(self, cm: AbstractContextManager[object], hook: AroundEnqueue) -> None:
        self.cm = cm
        self.hook = hook

    def __enter__(self) -> object:
        return self.cm.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.cm.__exit__(*exc_info)
        except Exception:
            log.exception("around-enqueue hook %s raised on exit; ignored", _name(self.hook))
        # None: the call's own exception, if any, goes on (a hook cannot swallow it).


def _name(hook: object) -> str:
    return str(getattr(hook, "__qualname__", hook))


def check_around_enqueue(func: object) -> AroundEnqueue:
    if not callable(func) or inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"around-enqueue hook {func!r} must be a plain function (publish) that returns a "
            "context manager"
        )
    return func


def check_middleware(func: object) -> Middleware:
    if not inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"middleware {func!r} must be an async function (ctx, call_next) that awaits "
            "call_next(); it wraps sync handlers too"
        )
    return func


def check_enqueue_hook(func: object) -> EnqueueHook:
    if not callable(func) or inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"enqueue hook {func!r} must be a plain function (task, args, meta) that adds to "
            "meta; it runs inside enqueue, sync and async"
        )
    return func


def run_enqueue_hooks(
    hooks: list[EnqueueHook], task: str, args: Mapping[str, Any] | None,
    meta: Mapping[str, Any] | None,
) -> Mapping[str, Any] | None:  # fmt: skip
    """The job's meta after every hook had its say (None if it stays empty and had none)."""
    changed = dict(meta) if meta is not None else {}
    for hook in hooks:
        try:
            hook(task, args or {}, changed)
        except Exception:
            log.exception(
                "enqueue hook %s raised for a job of task %r; the job is written without its "
                "changes", getattr(hook, "__qualname__", hook), task,
            )  # fmt: skip
    return changed if changed or meta is not None else None


async def call_through(
    middleware: list[Middleware],
    ctx: JobContext,
    handler: Callable[[], Awaitable[tuple[Any, bool | None]]],
) -> tuple[Any, bool | None]:
    """Run ``handler`` inside every middleware (see the module docstring for their errors)."""
    ran: dict[str, Any] = {}

    async def innermost() -> Any:
        try:
            ran["outcome"] = await handler()
        except BaseException as exc:
            ran["error"] = exc
            raise
        return ran["outcome"][0]

    call: Callable[[], Awaitable[Any]] = innermost
    for mw in reversed(middleware):
        call = _wrapped(mw, ctx, call)
    try:
        value = await call()
    except BaseException as exc:
        if "outcome" in ran and isinstance(exc, Exception):
            log.error(
                "a middleware raised after job %d's handler succeeded (%s: %s); the handler's "
                "result stands", ctx.job_id, type(exc).__name__, exc,
            )  # fmt: skip
            return ran["outcome"]  # type: ignore[no-any-return]
        if "error" not in ran and isinstance(exc, Exception):
            log.error(
                "a middleware raised before job %d's handler ran (%s: %s); the attempt fails "
                "and is retried like any failure", ctx.job_id, type(exc).__name__, exc,
            )  # fmt: skip
        raise
    if "outcome" in ran:
        return value, ran["outcome"][1]
    return value, None  # a middleware answered without calling the handler


def _wrapped(
    mw: Middleware, ctx: JobContext, call_next: Callable[[], Awaitable[Any]]
) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return await mw(ctx, call_next)

    return call
