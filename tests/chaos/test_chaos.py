"""Every fault scenario at a small size, inside `make test`. `make chaos` runs them larger.

Each run prints its seed; `python -m tests.chaos --seed N --scenario NAME` replays it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgqueue.embedded import EmbeddedPostgres, find_bindir
from tests.chaos.harness import Config
from tests.chaos.report import row
from tests.chaos.scenarios import SCENARIOS, run_scenario

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def chaos_cluster() -> Iterator[EmbeddedPostgres]:
    """A cluster of the chaos runs' own: one scenario restarts it."""
    if find_bindir() is None:
        pytest.skip("the fault suite needs the PostgreSQL server binaries (initdb, pg_ctl)")
    with EmbeddedPostgres() as cluster:
        yield cluster


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name: str, chaos_cluster: EmbeddedPostgres, tmp_path: Path) -> None:
    seed = int(os.environ.get("PGQUEUE_CHAOS_SEED", "0")) or int.from_bytes(os.urandom(3))
    print(f"seed {seed}: replay with python -m tests.chaos --seed {seed} --scenario {name}")
    result = run_scenario(chaos_cluster, Config(seed=seed), name, tmp_path)
    print(row(result))
    assert result.passed, f"{name} failed {result.failures}:\n" + "\n".join(result.notes)
