"""``pgqueue dashboard``: the click command the main CLI adds with ``add_command``."""

from __future__ import annotations

import click

from ..db import resolve_dsn
from ..errors import ConfigurationError
from .app import PublicBindError, serve


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--dsn", envvar="PGQUEUE_DSN", help="Database (default: $PGQUEUE_DSN, $DATABASE_URL)."
)
@click.option("--schema", default="public", show_default=True)
@click.option("--username", envvar="PGQUEUE_DASHBOARD_USERNAME", help="Basic auth user.")
@click.option(
    "--password", envvar="PGQUEUE_DASHBOARD_PASSWORD",
    help="Basic auth password (prefer $PGQUEUE_DASHBOARD_PASSWORD: argv is visible to ps).",
)  # fmt: skip
@click.option(
    "--allow-public", is_flag=True,
    help="Allow a non-loopback address without auth (something in front authenticates).",
)  # fmt: skip
@click.option("--allowed-host", "allowed_hosts", multiple=True, help="Host header to accept.")
@click.option("--refresh", default=1.0, show_default=True, type=float, help="Seconds.")
@click.option(
    "--late-after", default=15.0, show_default=True, type=float,
    help="Seconds without a heartbeat before a worker shows as late; keep it above the "
    "workers' heartbeat interval (lease / 3 by default, 10 s).",
)  # fmt: skip
@click.option(
    "--long-transaction", default=300.0, show_default=True, type=float,
    help="Seconds a transaction may hold back vacuum before the page warns of it.",
)  # fmt: skip
@click.option(
    "--dead-tuples", default=0.2, show_default=True, type=float,
    help="Warn when pgqueue_jobs has more dead rows than this share of its live ones "
    "(and at least 10,000).",
)  # fmt: skip
def dashboard_command(
    host: str,
    port: int,
    dsn: str | None,
    schema: str,
    username: str | None,
    password: str | None,
    allow_public: bool,
    allowed_hosts: tuple[str, ...],
    refresh: float,
    late_after: float,
    long_transaction: float,
    dead_tuples: float,
) -> None:
    """Serve the read-only live dashboard."""
    if bool(username) != bool(password):
        raise click.UsageError("basic auth needs both --username and --password")
    try:
        resolved = resolve_dsn(dsn)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    auth = (username, password) if username and password else None
    try:
        serve(
            resolved, schema, host, port, basic_auth=auth, allow_public=allow_public,
            allowed_hosts=list(allowed_hosts) or None, refresh_interval=refresh,
            late_heartbeat_seconds=late_after, long_transaction_seconds=long_transaction,
            dead_tuple_ratio=dead_tuples,
        )  # fmt: skip
    except (PublicBindError, ConfigurationError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
