"""The pytest entry point (``pytest11``): only the switch, so that installing pgqueue changes
nothing in anyone's test session. ``--pgqueue`` or ``pgqueue = true`` in the ini file loads
``pgqueue.testing.plugin`` (its fixtures); ``-p pgqueue.testing.plugin`` or
``pytest_plugins = ["pgqueue.testing.plugin"]`` load it directly."""

from __future__ import annotations

import pytest

PLUGIN = "pgqueue.testing.plugin"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pgqueue")
    group.addoption(
        "--pgqueue",
        action="store_true",
        default=False,
        help="enable pgqueue's fixtures (pgqueue_dsn, pgqueue_app): a migrated throwaway "
        "database per test, on $PGQUEUE_TEST_DSN or a throwaway cluster",
    )
    parser.addini("pgqueue", type="bool", default=False, help="enable pgqueue's fixtures")
    parser.addini(
        "pgqueue_app",
        default="",
        help="module:attribute of the pgqueue.App that the pgqueue_app fixture binds to each "
        "test's database (default: a new App per test)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("pgqueue") or config.getini("pgqueue"):
        config.pluginmanager.import_plugin(PLUGIN)
