"""Transactional enqueue with psycopg: the order and its receipt job commit together, or
neither exists."""

from __future__ import annotations

from typing import Any

import psycopg

from .tasks import send_receipt


def place_order(conn: psycopg.Connection[Any], customer: str, total_cents: int) -> int:
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents),
        ).fetchone()
        assert row is not None
        order_id: int = row[0]
        # Same connection, same transaction: the job row commits (or rolls back) with the order.
        send_receipt.configure(connection=conn).enqueue(order_id=order_id)
    return order_id
