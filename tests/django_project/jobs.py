"""A pgqueue App of the project's own (the backend's ``APP`` option): its tasks and Django's
run in the same workers. Tests put a fresh App here, as each test has its own database."""

from __future__ import annotations

import pgqueue

app = pgqueue.App()  # no DSN: the backend gives it Django's database
