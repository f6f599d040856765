"""`pgqueue demo` as a newcomer meets it: from a fresh clone with `make demo`, then with the
pgserver fallback and with a database of one's own. Each run waits for the dashboard URL,
reads the page and its JSON API until jobs have succeeded, failed and died, presses Ctrl-C,
and checks that nothing is left running and the throwaway database is gone.

The fresh-clone test clones the repository's committed HEAD: uncommitted changes are not in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgqueue.embedded import free_port, import_pgserver
from tests.helpers import ROOT, wait_until

pytestmark = [pytest.mark.acceptance, pytest.mark.slow]

URL = re.compile(r"^Dashboard: (http://127\.0\.0\.1:\d+/)$")
DATA = re.compile(r"(/\S*pgqueue-(?:pg|pgserver)-\w+)")


@dataclass
class DemoProcess:
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def find(self, pattern: re.Pattern[str]) -> str | None:
        for line in self.lines:
            match = pattern.search(line)
            if match:
                return match[1]
        return None

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> str:
        def found() -> str | None:
            if self.proc.poll() is not None and self.find(pattern) is None:
                raise AssertionError(f"the demo exited early:\n{self.output}")
            return self.find(pattern)

        try:
            return str(wait_until(found, timeout=timeout, interval=0.2))
        except AssertionError:
            raise AssertionError(
                f"no {pattern.pattern!r} in the demo's output:\n{self.output}"
            ) from None


@contextlib.contextmanager
def running_demo(args: list[str], cwd: Path, env: dict[str, str]) -> Iterator[DemoProcess]:
    # A session of its own, like a terminal: Ctrl-C reaches its whole foreground group.
    proc = subprocess.Popen(
        args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    demo = DemoProcess(proc)
    try:
        yield demo
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        demo.reader.join(10)
        assert proc.stdout is not None
        proc.stdout.close()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PGQUEUE_DSN", "DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV")}  # fmt: skip
    return {**env, **extra}


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def snapshot_shows_everything(url: str) -> dict[str, Any] | None:
    """True once the dashboard has seen jobs succeed, fail and die, both workers alive and the
    schedule fire."""
    try:
        status, body = get(url + "api/snapshot")
    except OSError:
        return None
    snap = json.loads(body)
    if status != 200 or snap.get("status") != "ok":
        return None
    fired = [s for s in snap["schedules"] if s["last_run"] is not None]
    done = (
        sum(snap["throughput"]["succeeded"]) > 0
        and sum(snap["throughput"]["failed"]) > 0
        and snap["problem_counts"]["dead"] > 0
        and snap["workers_alive"] == 2
        and fired
    )
    return snap if done else None


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def postmaster_pid(data_path: Path) -> int:
    for pidfile in (data_path / "data" / "postmaster.pid", data_path / "postmaster.pid"):
        if pidfile.exists():
            return int(pidfile.read_text().splitlines()[0])
    raise AssertionError(f"no postmaster.pid under {data_path}")


def exercise_and_stop(demo: DemoProcess, startup_timeout: float) -> dict[str, Any]:
    """Wait for the URL, check the page, the API and /metrics, press Ctrl-C, check cleanup."""
    url = demo.wait_for(URL, timeout=startup_timeout)
    status, page = get(url)
    assert status == 200 and "pgqueue" in page
    snap: dict[str, Any] = wait_until(
        lambda: snapshot_shows_everything(url), timeout=120, interval=1.0
    )
    status, metrics = get(url + "metrics")
    assert status == 200 and "pgqueue_jobs_finished" in metrics
    data_dir = demo.find(DATA)
    children = descendants(demo.proc.pid)
    postmaster = postmaster_pid(Path(data_dir)) if data_dir else None
    assert len([p for p in children if alive(p)]) >= 3, "two workers and a dashboard"

    os.killpg(demo.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    demo.proc.wait(timeout=90)
    wait_until(lambda: demo.find(re.compile(r"^(Stopped\.)")), timeout=10)
    wait_until(lambda: not any(alive(p) for p in children), timeout=30)
    if data_dir is not None:
        assert postmaster is not None
        wait_until(lambda: not alive(postmaster), timeout=30)
        assert not Path(data_dir).exists(), f"{data_dir} was left behind"
    return snap


@pytest.fixture
def fresh_clone(tmp_path: Path) -> Iterator[Path]:
    clone = tmp_path / "pgqueue"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    try:
        yield clone
    finally:
        shutil.rmtree(clone, ignore_errors=True)


@pytest.mark.timeout(900)
def test_make_demo_from_a_fresh_clone_shows_a_live_dashboard_and_stops_cleanly(
    fresh_clone: Path,
) -> None:
    args = ["make", "demo", f"DEMO_ARGS=--port {free_port()}"]
    with running_demo(args, cwd=fresh_clone, env=clean_env()) as demo:
        # Creating the virtualenv and installing from the package index come first.
        exercise_and_stop(demo, startup_timeout=600)
    leftovers = [cmdline(p) for p in all_pids() if alive(p) and str(fresh_clone) in cmdline(p)]
    assert not leftovers, f"processes from the clone still run: {leftovers}"


def all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(
    import_pgserver() is None, reason="needs pgqueue-jobs[embedded] (CPython <= 3.12)"
)
@pytest.mark.timeout(300)
def test_demo_falls_back_to_pgservers_postgresql(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "pgqueue.cli", "demo", "--postgres", "pgserver",
            "--port", str(free_port())]  # fmt: skip
    # pgserver keeps a lock file in the user's runtime directory, which is $TMPDIR/runtime-UID
    # where no XDG_RUNTIME_DIR is set: the test's own directory then, not one left behind.
    env = clean_env(XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR") or str(tmp_path))
    with running_demo(args, cwd=ROOT, env=env) as demo:
        exercise_and_stop(demo, startup_timeout=120)
    assert "pgserver" in demo.output
    assert demo.proc.returncode == 0, demo.output


@pytest.mark.timeout(300)
def test_demo_uses_the_database_it_is_given_in_a_schema_of_its_own(dsn: str) -> None:
    args = [sys.executable, "-m", "pgqueue.cli", "demo", "--port", str(free_port())]
    with running_demo(args, cwd=ROOT, env=clean_env(PGQUEUE_DSN=dsn)) as demo:
        exercise_and_stop(demo, startup_timeout=120)
    assert demo.proc.returncode == 0, demo.output
    assert demo.find(DATA) is None, "no throwaway server when a DSN is given"
    with psycopg.connect(dsn) as conn:
        demo_jobs = conn.execute("SELECT count(*) FROM pgqueue_demo.pgqueue_jobs").fetchone()
        own_jobs = conn.execute("SELECT count(*) FROM public.pgqueue_jobs").fetchone()
    assert demo_jobs is not None and demo_jobs[0] > 0
    assert own_jobs == (0,), "the demo must not touch the app's own queue"
    assert "DROP SCHEMA pgqueue_demo CASCADE" in demo.output
