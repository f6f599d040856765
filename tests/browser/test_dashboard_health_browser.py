"""The health strip in Chromium: a real idle-in-transaction session holding a snapshot is named
with its pid once past the threshold, and the strip goes when it ends."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.browser.conftest import CHROMIUM, Served, _open, serving

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"chromium not found at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True
    )

from playwright.sync_api import Page, expect


@pytest.fixture
def served(dsn: str) -> Iterator[Served]:
    """The dashboard with a threshold of a second for a transaction holding back vacuum."""
    with serving(dsn, long_transaction_seconds=1.0) as live:
        yield live


def test_a_transaction_holding_back_vacuum_is_named_then_the_strip_goes(
    page: Page, base_url: str, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    _open(page, base_url)
    strip = page.locator("#health")
    expect(strip).to_be_hidden()  # nothing wrong (and a superuser sees every session)
    with psycopg.connect(dsn, autocommit=True, application_name="forgotten-psql") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        pid = holder.info.backend_pid
        expect(strip).to_be_visible()
        expect(strip).to_contain_text(f"pid {pid}")
        expect(strip).to_contain_text("forgotten-psql")
        expect(strip).to_contain_text("idle in transaction")
        expect(strip).to_contain_text("holds back vacuum")
        expect(strip).not_to_have_class("banner health quiet")
        holder.execute("ROLLBACK")
        expect(strip).to_be_hidden()
