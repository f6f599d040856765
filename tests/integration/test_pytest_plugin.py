"""The pytest plugin, run by pytest itself (pytester) on a user's test files: off unless
enabled, and once enabled a migrated database per test, the user's app bound to it, and
run_until_idle draining it against the real PostgreSQL of this test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Server

ROOT = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]

USER_TESTS = """
import pgqueue
from pgqueue.testing import run_until_idle


def test_enqueue_drain_assert(pgqueue_app):
    @pgqueue_app.task
    def add(a: int, b: int) -> int:
        return a + b

    add.enqueue(a=1, b=2)
    assert run_until_idle(pgqueue_app).results == [3]


def test_a_failing_job_ends_dead(pgqueue_app):
    @pgqueue_app.task(max_attempts=2)
    def broken() -> None:
        raise RuntimeError("no")

    job = broken.enqueue()
    runs = run_until_idle(pgqueue_app)
    assert [r.status for r in runs] == ["retrying", "dead"]
    assert pgqueue_app.get_job(job).status == "dead"


def test_each_test_has_a_database_of_its_own(pgqueue_app, pgqueue_dsn):
    assert pgqueue_app.dsn == pgqueue_dsn
    assert pgqueue_app.status_counts() == []
"""

USER_APP = """
import pgqueue

app = pgqueue.App(schema="myjobs")


@app.task
def greet(name: str) -> str:
    return f"Hello, {name}!"
"""

USER_APP_TESTS = """
import jobs
from pgqueue.testing import run_until_idle


def test_the_users_own_app_is_bound(pgqueue_app):
    assert pgqueue_app is jobs.app
    jobs.greet.enqueue(name="Ada")
    assert run_until_idle(pgqueue_app).results == ["Hello, Ada!"]


def test_and_bound_again_for_the_next_test(pgqueue_app):
    jobs.greet.enqueue(name="Grace")
    assert run_until_idle(pgqueue_app).results == ["Hello, Grace!"]
"""


@pytest.fixture
def user_project(
    pytester: pytest.Pytester, pg_server: Server, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    """A user's project whose tests reach this session's PostgreSQL."""
    monkeypatch.setenv("PGQUEUE_TEST_DSN", pg_server.admin_dsn)
    monkeypatch.delenv("PGQUEUE_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return pytester


@pytest.mark.parametrize("enabled_by", ["flag", "ini", "-p", "pytest_plugins"])
def test_enabled_the_fixtures_give_each_test_a_migrated_database(
    user_project: pytest.Pytester, enabled_by: str
) -> None:
    user_project.makepyfile(test_user=USER_TESTS)
    args: list[str] = []
    if enabled_by == "flag":
        args = ["--pgqueue"]
    elif enabled_by == "ini":
        user_project.makeini("[pytest]\npgqueue = true\n")
    elif enabled_by == "-p":
        args = ["-p", "pgqueue.testing.plugin"]
    else:
        user_project.makeconftest('pytest_plugins = ["pgqueue.testing.plugin"]\n')
    result = user_project.runpytest_subprocess(*args)
    result.assert_outcomes(passed=3)


def test_the_guides_example_passes(
    user_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/testing/test_greetings.py, in a project configured as the guide says."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    user_project.makeini("[pytest]\npgqueue = true\npgqueue_app = examples.quickstart:app\n")
    user_project.makepyfile(
        test_greetings=(ROOT / "examples/testing/test_greetings.py").read_text()
    )
    result = user_project.runpytest_subprocess()
    result.assert_outcomes(passed=2)


def test_an_overridden_app_factory_in_its_own_schema_is_bound_per_test(
    user_project: pytest.Pytester,
) -> None:
    user_project.makepyfile(jobs=USER_APP)
    user_project.makeconftest(
        "import pytest\n"
        "import jobs\n"
        'pytest_plugins = ["pgqueue.testing.plugin"]\n'
        "@pytest.fixture\n"
        "def pgqueue_app_factory():\n"
        "    return lambda: jobs.app\n"
    )
    user_project.makepyfile(test_user=USER_APP_TESTS)
    result = user_project.runpytest_subprocess()
    result.assert_outcomes(passed=2)


def test_not_enabled_there_are_no_fixtures(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(test_user=USER_TESTS)
    result = user_project.runpytest_subprocess()
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(["*fixture 'pgqueue_app' not found*"])
    available = [line for line in result.stdout.lines if "available fixtures:" in line]
    assert available and not any("pgqueue_" in line for line in available)


def test_installed_but_not_enabled_it_adds_nothing_to_this_session(
    pytestconfig: pytest.Config,
) -> None:
    manager = pytestconfig.pluginmanager
    assert manager.get_plugin("pgqueue") is not None  # the entry point: the switch only
    assert manager.get_plugin("pgqueue.testing.plugin") is None
