"""Calls that mypy and pyright must accept, and calls each must refuse (marked
``# type: ignore[code]``): tests/typecheck/test_typed_enqueue.py runs both checkers on this
file without the markers and compares the lines they flag with the marked ones. Never run."""

from __future__ import annotations

from typing import Any

import psycopg

import pgqueue

app = pgqueue.App("postgresql://nobody@127.0.0.1:1/never")


@app.task
def send_email(to: str, subject: str, cc: list[str] | None = None) -> None: ...


@app.task
async def deliver(ctx: pgqueue.JobContext, url: str, payload: dict[str, Any]) -> None: ...


@app.task
async def charge(
    ctx: pgqueue.JobContext, conn: psycopg.AsyncConnection[Any], order_id: int
) -> None: ...


@app.task
def record(conn: psycopg.Connection[Any], amount: int) -> None: ...


@app.task
def tick() -> None: ...


@app.task
def total(results: list[int]) -> int:
    return sum(results)


@app.task
def loose(x, y):  # type: ignore[no-untyped-def]  # an untyped handler: anything goes
    return None


async def good_calls() -> None:
    send_email.enqueue(to="a@example.com", subject="Hi")
    send_email.enqueue(to="a@example.com", subject="Hi", cc=["b@example.com"])
    send_email.configure(delay=30, priority=5).enqueue(to="a@example.com", subject="Hi")
    await send_email.enqueue_async(to="a@example.com", subject="Hi")
    await send_email.configure(queue="mail").enqueue_async(to="a@example.com", subject="Hi")
    send_email.s(to="a@example.com", subject="Hi")
    deliver.enqueue(url="https://example.com", payload={"n": 1})
    await deliver.enqueue_async(url="https://example.com", payload={})
    charge.enqueue(order_id=7)
    charge.configure(priority=1).enqueue(order_id=7)
    record.enqueue(amount=100)
    tick.enqueue()
    tick.s()
    total.s()  # a callback: the worker fills its results
    total.configure(after=[1, 2]).enqueue()
    total.enqueue(results=[1, 2])
    loose.enqueue(x=1, y="two")
    send_email("a@example.com", "Hi")  # calling the task runs the handler, as declared


async def bad_calls() -> None:
    send_email.enqueue(to="a@example.com")  # type: ignore[call-arg]
    send_email.enqueue(to="a@example.com", subject=3)  # type: ignore[arg-type]
    send_email.enqueue(to="a@example.com", subject="Hi", bcc="x")  # type: ignore[call-arg]
    send_email.configure(delay=30).enqueue(too="a@example.com", subject="Hi")  # type: ignore[call-arg]
    await send_email.enqueue_async(to=1, subject="Hi")  # type: ignore[arg-type]
    send_email.s(to="a@example.com")  # type: ignore[call-arg]
    deliver.enqueue(url="https://example.com")  # type: ignore[call-overload]
    deliver.enqueue(url=b"https://example.com", payload={})  # type: ignore[call-overload]
    charge.enqueue(order_id="7")  # type: ignore[call-overload]
    charge.enqueue()  # type: ignore[call-overload]
    record.enqueue(amount=1.5)  # type: ignore[call-overload]
    tick.enqueue(n=1)  # type: ignore[call-arg]
    total.enqueue()  # type: ignore[call-arg]
    total.s(results=["a"])  # type: ignore[list-item]
