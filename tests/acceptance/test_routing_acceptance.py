"""`pgqueue worker` processes of an app with routes: each serves the cluster of its queues."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import pgqueue
from tests.helpers import ROOT, WorkerProcesses

pytestmark = pytest.mark.acceptance


@pytest.fixture
def workers(dsn: str, other_dsn: str, tmp_path: Path) -> Iterator[WorkerProcesses]:
    # The source tree under test before any installed copy, so a worktree's own code runs.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {"ROUTING_REPORTS_DSN": other_dsn, "PYTHONPATH": path}
    procs = WorkerProcesses(dsn, "tests.acceptance.routing_app:app", tmp_path, env)
    try:
        yield procs
    finally:
        procs.stop_all(15)


def test_a_worker_process_serves_the_cluster_of_its_queues(
    dsn: str, other_dsn: str, workers: WorkerProcesses
) -> None:
    app = pgqueue.App(dsn, routes={"reports": other_dsn})
    try:
        report = app.enqueue("report", {"n": 4}, queue="reports", allow_unknown=True)
        mail = app.enqueue("mail", {"n": 7}, allow_unknown=True)
        assert int(report) == int(mail) == 1  # one id, a job on each cluster
        workers.start("--queues", "reports")
        try:
            assert app.wait(report, timeout=60) == 40
            # The reports worker never touched the default cluster's job 1.
            found = app.get_job(mail)
            assert found is not None and found.status is pgqueue.Status.QUEUED
            workers.start()  # no --queues: the default cluster, every queue there
            assert app.wait(mail, timeout=60) == 7
        except BaseException:
            print(workers.output())
            raise
    finally:
        app.close()
