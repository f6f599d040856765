"""pgqueue in a Django project (Django 4.2+ with psycopg 3: ``pip install "psycopg[binary]"``).

Django's PostgreSQL backend uses psycopg 3 when it is installed, and ``connection.connection``
is then the psycopg connection that carries ``transaction.atomic()``'s transaction.
"""

from __future__ import annotations

from django.db import connection, transaction

from .tasks import send_receipt


def place_order(customer: str, total_cents: int) -> int:
    with transaction.atomic():
        with connection.cursor() as cursor:  # or Order.objects.create(...) with a model
            cursor.execute(
                "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
                [customer, total_cents],
            )
            order_id: int = cursor.fetchone()[0]
        # connection.connection is the psycopg connection inside the atomic block.
        send_receipt.configure(connection=connection.connection).enqueue(order_id=order_id)
    return order_id
