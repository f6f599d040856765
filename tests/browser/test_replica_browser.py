"""The header on a hot standby: "replica, N s behind". The standby itself is
tests/acceptance/test_replica.py's; here the snapshot says replica, so the page's text is tested
without starting a second cluster."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pgqueue.dashboard import queries
from tests.browser.conftest import CHROMIUM, Served, _open

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"chromium not found at {CHROMIUM}: apt-get install -y chromium", allow_module_level=True
    )

from playwright.sync_api import Page, expect


def test_the_header_says_how_far_behind_a_replica_is(
    page: Page, served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    refresher = served.refresher
    build = refresher._build
    replica: dict[str, Any] = {"lag": 3.2, "streaming": True}

    def as_on_a_replica(reading: queries.Reading) -> dict[str, Any]:
        reading.replica = dict(replica)
        return build(reading)

    monkeypatch.setattr(refresher, "_build", as_on_a_replica)
    _open(page, served.url)
    expect(page.locator("#conn-replica")).to_have_text("replica, 3.20 s behind")
    replica["lag"] = 0.0
    expect(page.locator("#conn-replica")).to_have_text("replica, < 1 s behind")
    replica["lag"] = None
    expect(page.locator("#conn-replica")).to_have_text("replica, lag unknown")
    monkeypatch.setattr(refresher, "_build", build)  # a primary: nothing said
    expect(page.locator("#conn-replica")).to_have_text("")
