"""pgqueue in a FastAPI app: async enqueue from endpoints, and a transactional one.

uvicorn examples.shop.fastapi_app:api
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
from fastapi import FastAPI
from pydantic import BaseModel

from .tasks import app as queue
from .tasks import send_receipt


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    # Checks pgqueue's configuration at startup; closes its connections at shutdown.
    async with queue:
        yield


api = FastAPI(lifespan=lifespan)


class NewOrder(BaseModel):
    customer: str
    total_cents: int


@api.post("/orders/{order_id}/resend-receipt", status_code=202)
async def resend_receipt(order_id: int) -> dict[str, int]:
    """Fire and forget: pgqueue's own pool, one INSERT, the job id back."""
    job_id = await send_receipt.enqueue_async(order_id=order_id)
    return {"job_id": job_id}


@api.post("/orders", status_code=201)
async def create_order(order: NewOrder) -> dict[str, int]:
    """The order and its receipt job in one transaction. A real app takes the connection
    from its own pool (for example a psycopg_pool.AsyncConnectionPool dependency)."""
    async with await psycopg.AsyncConnection.connect(queue.dsn) as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (order.customer, order.total_cents),
        )
        row = await cur.fetchone()
        assert row is not None
        order_id: int = row[0]
        await send_receipt.configure(connection=conn).enqueue_async(order_id=order_id)
    return {"order_id": order_id}
