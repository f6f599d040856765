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
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .context import JobContext
from .errors import ConfigurationError

log = logging.getLogger("pgqueue.hooks")

#: ``async def middleware(ctx, call_next) -> result``
Middleware = Callable[[JobContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]
#: ``def hook(task, args, meta) -> None``; adds to ``meta`` in place.
EnqueueHook = Callable[[str, Mapping[str, Any], dict[str, Any]], None]


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
