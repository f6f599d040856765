"""Transactional enqueue with SQLAlchemy 2 (psycopg 3 driver: ``postgresql+psycopg://``)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .tasks import send_receipt


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]


def place_order(session: Session, customer: str, total_cents: int) -> int:
    """Call inside ``with Session(engine) as session, session.begin():``."""
    order = Order(customer=customer, total_cents=total_cents)
    session.add(order)
    session.flush()  # INSERT now, inside the session's transaction, to learn the id
    # The job is written on the connection that carries this session's transaction.
    send_receipt.configure(connection=session).enqueue(order_id=order.id)
    return order.id


async def place_order_async(session: AsyncSession, customer: str, total_cents: int) -> int:
    """Call inside ``async with AsyncSession(engine) as session, session.begin():``."""
    order = Order(customer=customer, total_cents=total_cents)
    session.add(order)
    await session.flush()
    await send_receipt.configure(connection=session).enqueue_async(order_id=order.id)
    return order.id
