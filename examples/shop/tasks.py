"""The shop's pgqueue app. Workers run it with ``pgqueue worker --app examples.shop.tasks:app``."""

from __future__ import annotations

import pgqueue

app = pgqueue.App()

#: The table the examples write orders to (a real project has it in its own migrations).
CREATE_ORDERS = """
CREATE TABLE IF NOT EXISTS orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text NOT NULL,
    total_cents integer NOT NULL
)
"""


@app.task(queue="emails", max_attempts=10)
def send_receipt(order_id: int) -> None:
    """Look the order up and e-mail the customer (left out here)."""
