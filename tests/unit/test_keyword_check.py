"""Enqueue's quick argument check (tasks._keyword_rules) accepts exactly the keyword calls
inspect.Signature.bind accepts, for every kind of parameter a handler may declare."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgqueue
from pgqueue.errors import InvalidJobError

NAMES = ["a", "b", "c", "ctx", "extra"]


def handlers() -> list[Any]:
    def plain(a: int, b: int = 1) -> None: ...
    def keyword_only(a: int, *, b: int, c: int = 0) -> None: ...
    def open_ended(a: int, **rest: Any) -> None: ...
    def star_args(*args: Any, b: int = 0) -> None: ...
    def positional_only(a: int, /, b: int = 0) -> None: ...
    def positional_only_default(a: int = 0, /, b: int = 0) -> None: ...
    def with_context(ctx: pgqueue.JobContext, a: int) -> None: ...
    def nothing() -> None: ...

    return [plain, keyword_only, open_ended, star_args, positional_only,
            positional_only_default, with_context, nothing]  # fmt: skip


def slow_accepts(task: pgqueue.Task[Any, Any], kwargs: dict[str, Any]) -> bool:
    params = [p for n, p in task.signature.parameters.items() if n != task.context_param]
    try:
        task.signature.replace(parameters=params).bind(**kwargs)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("index", range(len(handlers())))
@settings(deadline=None)
@given(chosen=st.sets(st.sampled_from(NAMES)))
def test_the_quick_check_agrees_with_bind(index: int, chosen: set[str]) -> None:
    app = pgqueue.App("postgresql://unused")
    task = app.task(handlers()[index])
    kwargs = dict.fromkeys(chosen, 1)
    if slow_accepts(task, kwargs):
        task.check_args(kwargs)
    else:
        with pytest.raises(InvalidJobError, match="arguments do not match"):
            task.check_args(kwargs)
