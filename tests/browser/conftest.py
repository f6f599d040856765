"""Fixtures of the browser tests: headless Chromium (Debian's, never a download) and a live
dashboard on the test's own database."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright
from starlette.applications import Starlette

from pgqueue.dashboard.app import create_app
from pgqueue.dashboard.refresh import Refresher
from tests.helpers import wait_until

CHROMIUM = os.environ.get("PGQUEUE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

# Assertions retry until this deadline (Playwright's default is 5 s): Chromium, the dashboard
# and PostgreSQL share a loaded 2-core machine with the rest of the suite.
expect.set_options(timeout=30_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"chromium not found at {CHROMIUM}: apt-get install -y chromium")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    app: Starlette

    @property
    def refresher(self) -> Refresher:
        refresher: Refresher = self.app.state.refresher
        return refresher


@contextlib.contextmanager
def serving(dsn: str, **options: Any) -> Iterator[Served]:
    """A live dashboard on a free port; ``options`` go to ``create_app``."""
    port = _free_port()
    app = create_app(dsn, **{"refresh_interval": 0.3, **options})
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=1, lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "dashboard did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def served(dsn: str) -> Iterator[Served]:
    with serving(dsn) as live:
        yield live


@pytest.fixture
def base_url(served: Served) -> str:
    return served.url


@pytest.fixture
def page(browser: Browser, base_url: str) -> Iterator[Page]:
    """A tab that closes before the server stops (an open event stream would hold it up)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))

    def on_dialog(dialog: Dialog) -> None:
        errors.append("dialog: " + dialog.message)
        dialog.dismiss()

    tab.on("dialog", on_dialog)
    yield tab
    found = list(errors)
    context.close()
    assert found == [], found  # no CSP violations, script errors or alert() calls


def _refresh(page: Page) -> int:
    return int(page.locator("body").get_attribute("data-refresh") or 0)


def _open(page: Page, url: str) -> None:
    page.goto(url)
    # Polled from Python: Playwright's wait_for_function would eval() under the page's CSP.
    wait_until(lambda: _refresh(page) > 0)
