"""The ``pgqueue bench`` command (needs the ``bench`` extra: rich)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import click


def _default_peers_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pgqueue" / "bench-peers"


@click.command("bench")
@click.option("--dsn", help="Server to use (needs CREATE DATABASE). Default: a throwaway one.")
@click.option("--peers", is_flag=True, help="Also run Procrastinate and PgQueuer.")
@click.option("--peers-dir", type=click.Path(path_type=Path), default=Path("benchmarks/peers"),
              show_default=True, help="The peers' adapters (in a source checkout).")  # fmt: skip
@click.option("--peers-venv", type=click.Path(path_type=Path), default=None,
              help="Where the peers get installed (default: ~/.cache/pgqueue/bench-peers).")  # fmt: skip
@click.option("--quick", is_flag=True, help="Smaller runs: a couple of minutes.")
@click.option("--reps", type=click.IntRange(min=1), default=None, help="Repetitions (3).")
@click.option("--only", default="", help="Comma-separated workload keys (see --json output).")
@click.option("--long-tx-rate", type=click.FloatRange(min=1), default=None,
              help="long_tx: jobs/s offered (2,000).")  # fmt: skip
@click.option("--long-tx-hold", type=click.FloatRange(min=1), default=None,
              help="long_tx: seconds the snapshot is held (600; --quick 90).")  # fmt: skip
@click.option("--long-tx-clean", type=click.FloatRange(min=1), default=None,
              help="long_tx: seconds before it (60; --quick 30).")  # fmt: skip
@click.option("--long-tx-recovery", type=click.FloatRange(min=1), default=None,
              help="long_tx: seconds after it (60; --quick 45).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown.")
@click.option("--load", "load_path", type=click.Path(path_type=Path, exists=True), default=None,
              help="Render a report saved with --save instead of running.")  # fmt: skip
@click.option("--save", type=click.Path(path_type=Path), default=None,
              help="Also write the JSON report to this file.")  # fmt: skip
@click.option("--logs", type=click.Path(path_type=Path), default=None,
              help="Keep the adapter logs here (default: kept only if the run fails).")  # fmt: skip
def bench_command(
    dsn: str | None,
    peers: bool,
    peers_dir: Path,
    peers_venv: Path | None,
    quick: bool,
    reps: int | None,
    only: str,
    long_tx_rate: float | None,
    long_tx_hold: float | None,
    long_tx_clean: float | None,
    long_tx_recovery: float | None,
    as_json: bool,
    markdown: bool,
    load_path: Path | None,
    save: Path | None,
    logs: Path | None,
) -> None:
    """Measure enqueue, processing, pickup latency, steady state, depth, claims beside delayed
    jobs, drains under limits and the coalescing producer (with --peers: side by side with the
    peers, interleaved, medians of 3). ``--only long_tx`` measures a held snapshot (on request
    only: it takes minutes per system)."""
    try:
        from rich.console import Console
    except ImportError:
        click.echo(
            "error: the benchmark needs its extra: pip install 'pgqueue-jobs[bench]'", err=True
        )
        sys.exit(1)
    from . import runner

    console = Console(stderr=as_json, width=None if sys.stdout.isatty() else 160)
    plan = runner.Plan.make(quick, reps)
    plan.only = {key.strip() for key in only.split(",") if key.strip()}
    for name, value in (
        ("long_tx_rate", long_tx_rate),
        ("long_tx_hold", long_tx_hold),
        ("long_tx_clean", long_tx_clean),
        ("long_tx_recovery", long_tx_recovery),
    ):
        if value is not None:
            setattr(plan, name, value)
    known = {w.key for w in runner.Plan.make(quick, reps).workloads()} | {"ceiling"}
    known |= runner.ON_REQUEST
    if plan.only - known:
        click.echo(
            f"error: unknown workload(s) {', '.join(sorted(plan.only - known))}; "
            f"choose from {', '.join(sorted(known))}",
            err=True,
        )
        sys.exit(1)
    systems = runner.pgqueue_systems()
    if peers and load_path is None:
        if not (peers_dir / "requirements.txt").exists():
            click.echo(
                f"error: no peer adapters in {peers_dir}: run from a pgqueue source checkout "
                "or pass --peers-dir",
                err=True,
            )
            sys.exit(1)
        venv = peers_venv or _default_peers_venv()
        runner.ensure_peer_venv(peers_dir.resolve(), venv, console)
        systems += runner.peer_systems(peers_dir.resolve(), venv)
    if load_path is not None:
        systems = runner.pgqueue_systems() + runner.peer_systems(Path("."), Path("."))
        results = runner.load(load_path, systems)
    else:
        results = _run(dsn, plan, systems, console, logs)
    if save is not None:
        save.write_text(runner.dump(results) + "\n")
    if as_json:
        click.echo(runner.dump(results))
    elif markdown:
        click.echo(runner.markdown(results))
    else:
        runner.render(results, console)


def _run(dsn: str | None, plan: Any, systems: list[Any], console: Any, logs: Path | None) -> Any:
    from ..embedded import EmbeddedPostgres
    from . import runner

    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    server = None if dsn else EmbeddedPostgres().start()
    try:
        admin = dsn or (server.dsn if server else "")
        return asyncio.run(runner.run(admin, plan, systems, console, logs))
    finally:
        if server is not None:
            server.stop()
