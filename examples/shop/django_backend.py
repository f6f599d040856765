"""Django tasks on pgqueue: Django's own ``@task`` API, with pgqueue as the TASKS backend.

settings.py::

    INSTALLED_APPS = [..., "pgqueue.contrib.django"]
    TASKS = {
        "default": {
            "BACKEND": "pgqueue.contrib.django.PgQueueBackend",
            "QUEUES": ["default", "emails"],
        }
    }
"""

from __future__ import annotations

from django.db import connection, transaction

try:
    from django.tasks import task  # Django 6
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import task


@task(queue_name="emails")
def send_receipt(order_id: int) -> str:
    """Look the order up and e-mail the customer (left out here)."""
    return f"receipt for order {order_id} sent"


def place_order(customer: str, total_cents: int) -> tuple[int, str]:
    """The order and its receipt task commit together, or neither exists."""
    with transaction.atomic():
        with connection.cursor() as cursor:  # or Order.objects.create(...) with a model
            cursor.execute(
                "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
                [customer, total_cents],
            )
            order_id: int = cursor.fetchone()[0]
        result = send_receipt.enqueue(order_id=order_id)  # on Django's connection, in atomic()
    return order_id, result.id
