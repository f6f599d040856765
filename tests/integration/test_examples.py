"""The guides' examples (examples/), run against a real PostgreSQL: what the docs show works."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgqueue
from examples import quickstart
from examples.shop import tasks
from tests.helpers import running_worker, sqlalchemy_url, wait_until, wait_until_async

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def shop(dsn: str, conn: Conn, monkeypatch: pytest.MonkeyPatch) -> Iterator[pgqueue.App]:
    """The shop app on this test's database, with its orders table."""
    monkeypatch.setenv("PGQUEUE_DSN", dsn)
    conn.execute(tasks.CREATE_ORDERS)
    try:
        yield tasks.app
    finally:
        tasks.app.close()


def receipts(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT o.id, j.queue FROM orders o"
        " JOIN pgqueue_jobs j ON j.task = 'send_receipt' AND (j.args->>'order_id')::bigint = o.id"
    ).fetchall()


def sessions(conn: Conn) -> int:
    """Other connections to the test's database than ``conn``."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def counts(conn: Conn) -> tuple[int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM pgqueue_jobs)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def test_quickstart_task_runs_in_a_worker(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGQUEUE_DSN", dsn)
    app = quickstart.app
    try:
        job_id = await quickstart.greet.enqueue_async(name="Ada")
        async with running_worker(app, concurrency=2):

            async def done() -> pgqueue.Job | None:
                job = app.get_job(job_id)
                return job if job and job.status is pgqueue.Status.SUCCEEDED else None

            job = await wait_until_async(done, timeout=30)
        assert job.result == "Hello, Ada!"
        assert job.queue == "greetings"
    finally:
        app.close()
        await app.aclose()


def test_psycopg_order_and_receipt_commit_together(dsn: str, conn: Conn, shop: pgqueue.App) -> None:
    from examples.shop.orders_psycopg import place_order

    with psycopg.connect(dsn) as own:
        order_id = place_order(own, "ada", 4200)
    assert receipts(conn) == [(order_id, "emails")]


def test_psycopg_rollback_leaves_neither_order_nor_job(
    dsn: str, conn: Conn, shop: pgqueue.App
) -> None:
    from examples.shop.orders_psycopg import place_order

    with psycopg.connect(dsn) as own, pytest.raises(RuntimeError), own.transaction():
        place_order(own, "ada", 4200)
        raise RuntimeError("payment provider said no")
    assert counts(conn) == (0, 0)


def test_sqlalchemy_order_and_receipt_commit_or_roll_back_together(
    dsn: str, conn: Conn, shop: pgqueue.App
) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from examples.shop.orders_sqlalchemy import place_order

    engine = create_engine(sqlalchemy_url(dsn))
    try:
        with Session(engine) as session, session.begin():
            order_id = place_order(session, "ada", 4200)
        assert receipts(conn) == [(order_id, "emails")]

        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            place_order(session, "grace", 100)
            raise RuntimeError("out of stock")
        assert counts(conn) == (1, 1)
    finally:
        engine.dispose()


async def test_sqlalchemy_async_order_and_receipt_commit_or_roll_back_together(
    dsn: str, conn: Conn, shop: pgqueue.App
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from examples.shop.orders_sqlalchemy import place_order_async

    engine = create_async_engine(sqlalchemy_url(dsn))
    try:
        async with AsyncSession(engine) as session, session.begin():
            order_id = await place_order_async(session, "ada", 4200)
        assert receipts(conn) == [(order_id, "emails")]

        with pytest.raises(RuntimeError):
            async with AsyncSession(engine) as session, session.begin():
                await place_order_async(session, "grace", 100)
                raise RuntimeError("out of stock")
        assert counts(conn) == (1, 1)
    finally:
        await engine.dispose()


async def test_fastapi_endpoints_enqueue(conn: Conn, shop: pgqueue.App) -> None:
    import httpx2

    from examples.shop.fastapi_app import api

    transport = httpx2.ASGITransport(app=api)  # it does not run the lifespan: entered here
    async with api.router.lifespan_context(api):
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as client:
            created = await client.post("/orders", json={"customer": "ada", "total_cents": 4200})
            assert created.status_code == 201
            order_id = created.json()["order_id"]
            resent = await client.post(f"/orders/{order_id}/resend-receipt")
            assert resent.status_code == 202
        assert sessions(conn) == 1  # pgqueue's pool for this loop, open while the app runs
    wait_until(lambda: sessions(conn) == 0, what="the lifespan closed pgqueue's connections")
    assert receipts(conn) == [(order_id, "emails"), (order_id, "emails")]
    job = shop.get_job(resent.json()["job_id"])
    assert job is not None and job.args == {"order_id": order_id}


def test_django_order_and_receipt_commit_or_roll_back_together(
    dsn: str, conn: Conn, shop: pgqueue.App
) -> None:
    from django.db import connections, transaction

    from tests import django_project

    django_project.use_database(dsn)
    from examples.shop.django_orders import place_order

    try:
        order_id = place_order("ada", 4200)
        assert receipts(conn) == [(order_id, "emails")]
        with pytest.raises(RuntimeError), transaction.atomic():
            place_order("grace", 100)
            raise RuntimeError("out of stock")
        assert counts(conn) == (1, 1)
    finally:
        connections.close_all()


def test_django_task_and_order_commit_or_roll_back_together(
    dsn: str, conn: Conn, shop: pgqueue.App
) -> None:
    from django.db import connections, transaction

    from tests import django_project

    django_project.use_database(dsn)
    from examples.shop.django_backend import place_order, send_receipt

    try:
        order_id, result_id = place_order("ada", 4200)
        tasks = conn.execute("SELECT queue, args FROM pgqueue_jobs").fetchall()
        path = "examples.shop.django_backend.send_receipt"
        assert tasks == [("emails", {"path": path, "args": [], "kwargs": {"order_id": order_id}})]
        assert send_receipt.get_result(result_id).status == "READY"
        with pytest.raises(RuntimeError), transaction.atomic():
            place_order("grace", 100)
            raise RuntimeError("out of stock")
        assert counts(conn) == (1, 1)
    finally:
        django_project.close_task_backends()
        connections.close_all()
