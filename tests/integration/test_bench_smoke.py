"""`pgqueue bench` works end to end (tiny workloads; figures are not checked, only their shape)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pgqueue.bench import runner
from pgqueue.bench.processes import find_postmaster
from tests.conftest import Server


def bench(
    server: Server, tmp: Path, *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``pgqueue bench`` with ``tmp`` as its temporary directory, so a test sees what it leaves."""
    return subprocess.run(
        [sys.executable, "-m", "pgqueue.cli", "bench", "--dsn", server.admin_dsn, *args],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip


@pytest.mark.slow
def test_bench_runs_and_prints_json(pg_server: Server, tmp_path: Path) -> None:
    out = bench(
        pg_server, tmp_path, "--quick", "--reps", "1",
        "--only", "enqueue_4,enqueue_bulk,latency_notify", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # the adapter logs went with the run that succeeded
    report = json.loads(out.stdout)
    medians = report["medians"]
    assert medians["enqueue_bulk"]["pgqueue"]["rate"] > 0
    # Single-row producers run four ways: nobody waiting, a worker waiting, trigger off, and
    # every job unique; bulk runs plain and unique.
    assert {k for k, v in medians["enqueue_4"].items() if v["rate"] > 0} == {
        "pgqueue",
        "pgqueue-waiting",
        "pgqueue-no-notify",
        "pgqueue-unique",
    }
    assert medians["enqueue_bulk"]["pgqueue-unique"]["rate"] > 0
    # One job per call: each call's latency too (issue 23: p50 no worse than PgQueuer's).
    single = medians["enqueue_4"]["pgqueue"]
    assert 0 < single["p50"] <= single["p99"]
    assert "p50" not in medians["enqueue_bulk"]["pgqueue"]
    latency = medians["latency_notify"]["pgqueue"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
    assert report["postgresql"]["fsync"] == "on"
    assert len(report["runs"]["enqueue_bulk"]["pgqueue"]) == 1
    # Each run records the CPU steal while it ran (where /proc/stat exists): it, not the code,
    # moves rates between repetitions on a shared virtual machine.
    if Path("/proc/stat").exists():
        steal = report["runs"]["enqueue_bulk"]["pgqueue"][0]["cpu_steal_pct"]
        assert 0.0 <= steal <= 100.0


@pytest.mark.slow
def test_bench_depth_compares_with_the_same_jobs_on_an_empty_table(
    pg_server: Server, tmp_path: Path
) -> None:
    out = bench(pg_server, tmp_path, "--quick", "--reps", "1", "--only", "depth", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = json.loads(out.stdout)["runs"]["depth"]["pgqueue"]
    assert run["rate"] > 0 and run["empty_rate"] > 0
    assert run["vs_empty"] == pytest.approx(run["rate"] / run["empty_rate"])


@pytest.mark.slow
def test_bench_delayed_compares_claims_with_and_without_delayed_jobs(
    pg_server: Server, tmp_path: Path
) -> None:
    out = bench(pg_server, tmp_path, "--quick", "--reps", "1", "--only", "delayed", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["runs"]["delayed"]) == {"pgqueue"}  # the peers and variants do not run it
    (run,) = report["runs"]["delayed"]["pgqueue"]
    assert run["rate"] > 0 and run["empty_rate"] > 0
    assert run["vs_empty"] == pytest.approx(run["rate"] / run["empty_rate"])
    assert run["claim_ms"] > 0 and run["empty_claim_ms"] > 0
    assert run["claim_vs_empty"] == pytest.approx(run["claim_ms"] / run["empty_claim_ms"])


@pytest.mark.slow
def test_bench_limits_compares_limited_drains_with_the_unlimited_one(
    pg_server: Server, tmp_path: Path
) -> None:
    out = bench(pg_server, tmp_path, "--quick", "--reps", "1", "--only", "limits", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["runs"]["limits"]) == {"pgqueue"}  # the peers and variants do not run it
    (run,) = report["runs"]["limits"]["pgqueue"]
    assert run["plain_rate"] > 0 and run["key_rate"] > 0 and run["queue_rate"] > 0
    assert run["key_vs_plain"] == pytest.approx(run["key_rate"] / run["plain_rate"])
    assert run["queue_vs_plain"] == pytest.approx(run["queue_rate"] / run["plain_rate"])
    assert run["key_worker_cpu_per_1k"] > 0


def test_bench_peers_need_the_adapters(pg_server: Server, tmp_path: Path) -> None:
    out = bench(pg_server, tmp_path, "--peers", "--peers-dir", "/nonexistent", timeout=60)
    assert out.returncode == 1
    assert "no peer adapters" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_finds_the_postmaster_every_time(pg_server: Server) -> None:
    """PostgreSQL CPU is read from the postmaster's process tree; it was found through a backend
    that could exit before it was read, and a whole run then reported no PostgreSQL CPU."""
    if pg_server.cluster is None:
        pytest.skip("the server under PGQUEUE_TEST_DSN may not be on this machine")
    expected = int((pg_server.cluster.datadir / "postmaster.pid").read_text().split()[0])
    assert [find_postmaster(pg_server.admin_dsn) for _ in range(30)] == [expected] * 30


@pytest.mark.slow
def test_bench_coalesce_compares_coalescing_on_and_off_in_pairs(
    pg_server: Server, tmp_path: Path
) -> None:
    out = bench(pg_server, tmp_path, "--quick", "--reps", "1", "--only", "coalesce", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report["runs"]["coalesce"]) == {"pgqueue"}  # the peers and variants do not run it
    (run,) = report["runs"]["coalesce"]["pgqueue"]
    assert run["rate"] > 0 and run["off_rate"] > 0
    assert run["speedup"] == pytest.approx(run["rate"] / run["off_rate"])
    assert 0 < run["p50"] <= run["p99"] and 0 < run["off_p50"] <= run["off_p99"]
    assert run["per_batch"] >= 1


@pytest.mark.slow
def test_bench_long_tx_reports_each_phase_and_runs_only_when_asked(
    pg_server: Server, tmp_path: Path
) -> None:
    out = bench(
        pg_server, tmp_path, "--reps", "1", "--only", "long_tx", "--long-tx-rate", "200",
        "--long-tx-clean", "3", "--long-tx-hold", "4", "--long-tx-recovery", "4", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    # pgqueue, and pgqueue with claims always from the start of the index (as before issue 22).
    assert set(report["runs"]["long_tx"]) == {"pgqueue", "pgqueue-from-start"}
    (run,) = report["runs"]["long_tx"]["pgqueue"]
    assert run["held_done"] > 0 and 4 <= run["hold_s"] <= 8
    for phase in ("clean", "held", "recovery"):
        assert run[f"{phase}_offered"] > 0
        assert 0 < run[f"{phase}_p50"] <= run[f"{phase}_p99"]
    assert run["held_backlog"] >= 0 and run["recovery_backlog"] >= 0
    assert report["long_tx"] == {"rate": 200.0, "clean": 3.0, "hold": 4.0, "recovery": 4.0}
    # Not part of the default table: it takes minutes per system.
    assert "long_tx" not in {w.key for w in runner.Plan.make(False, None).workloads()}
