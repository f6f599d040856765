"""DSN resolution, schema quoting and connection errors.

Identifiers never reach SQL as raw strings: the schema is validated against a conservative
pattern and then quoted with ``psycopg.sql.Identifier``.
"""

from __future__ import annotations

import os
import re

import psycopg
from psycopg import conninfo

from .errors import ConfigurationError, DatabaseUnavailableError

_SCHEMA_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,49}$")

#: Detect a dead peer within about 15 s instead of hours: keepalives for an idle connection,
#: tcp_user_timeout for one whose bytes go unacknowledged, and a bounded connect. Workers and
#: producers set them on their connections (the DSN can override the producers').
KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 5,
    "tcp_user_timeout": 15000,
    "connect_timeout": 10,
}
#: The same bounds on the server's side, for a transaction of pgqueue's that the server waits
#: in for its client (a bulk enqueue's COPY, a chain, a group): database_now_bounded's parameters.
SERVER_KEEPALIVES: dict[str, str] = {
    "idle": str(KEEPALIVES["keepalives_idle"]),
    "interval": str(KEEPALIVES["keepalives_interval"]),
    "count": str(KEEPALIVES["keepalives_count"]),
    "user_timeout": str(KEEPALIVES["tcp_user_timeout"]),
}


def resolve_dsn(dsn: str | None = None) -> str:
    """The DSN argument, else ``$PGQUEUE_DSN``, else ``$DATABASE_URL``."""
    value = dsn or os.environ.get("PGQUEUE_DSN") or os.environ.get("DATABASE_URL")
    if not value:
        raise ConfigurationError(
            "no database configured: pass dsn=..., or set PGQUEUE_DSN or DATABASE_URL"
        )
    try:
        conninfo.conninfo_to_dict(value)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid DSN: {exc}") from None
    return value


_FLAGS = {"1": True, "on": True, "true": True, "yes": True,
          "0": False, "off": False, "false": False, "no": False}  # fmt: skip


def parse_flag(name: str, value: str | None, default: bool) -> bool:
    """An on/off setting from the environment; anything else is a clear error."""
    if value is None or not value.strip():
        return default
    try:
        return _FLAGS[value.strip().lower()]
    except KeyError:
        raise ConfigurationError(f"{name} must be on or off, got {value!r}") from None


def validate_schema(schema: str) -> str:
    """Accept plain identifiers only; quotes, dots and semicolons are refused outright."""
    if not isinstance(schema, str) or not _SCHEMA_RE.match(schema):
        raise ConfigurationError(
            f"invalid schema name {schema!r}: use letters, digits and underscores "
            "(at most 50 characters, not starting with a digit)"
        )
    return schema


def channel_for(schema: str) -> str:
    """The NOTIFY channel of a schema; under PostgreSQL's 63-byte limit by construction."""
    return "pgqueue" if schema == "public" else f"pgqueue_{schema}"


def done_channel_for(schema: str) -> str:
    """The channel on which finished jobs are announced to ``App.wait`` (63 bytes at most)."""
    return f"{channel_for(schema)}_done"


def describe_dsn(dsn: str) -> str:
    """host:port/dbname for messages, never the password."""
    try:
        parts = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<invalid DSN>"
    hosts = str(parts.get("host") or parts.get("hostaddr") or "localhost").split(",")
    ports = str(parts.get("port") or "5432").split(",")
    if len(ports) == 1:  # one port for every host (libpq's rule)
        ports *= len(hosts)
    db = parts.get("dbname") or parts.get("user") or ""
    servers = ",".join(
        f"{h or 'localhost'}:{p or '5432'}" for h, p in zip(hosts, ports, strict=False)
    )
    return f"{servers}/{db}"


def unavailable(dsn: str, exc: BaseException) -> DatabaseUnavailableError:
    """One sentence for an unreachable database: libpq's reason, without its preamble."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = first.rsplit(" failed: ", 1)[-1].replace("FATAL:  ", "")
    return DatabaseUnavailableError(
        f"cannot connect to PostgreSQL at {describe_dsn(dsn)}: {reason}"
    )


def lost(dsn: str, exc: BaseException, *, read_only: bool = False) -> DatabaseUnavailableError:
    """One sentence for a connection lost during a statement. A write's fate is then unknown:
    the server may have committed it before the connection went."""
    lines = str(exc).strip().splitlines()
    reason = lines[0].rsplit(" failed: ", 1)[-1] if lines else type(exc).__name__
    outcome = "" if read_only else "; the write may or may not have been applied"
    return DatabaseUnavailableError(
        f"lost the connection to PostgreSQL at {describe_dsn(dsn)}: {reason}{outcome}",
        uncertain=not read_only,
    )


def connect(dsn: str, *, autocommit: bool = True, **kwargs: object) -> psycopg.Connection[object]:
    """A sync connection, with connection failures turned into DatabaseUnavailableError."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, **kwargs)  # type: ignore[arg-type]
    except psycopg.OperationalError as exc:
        raise unavailable(dsn, exc) from None


async def connect_async(
    dsn: str, *, autocommit: bool = True, **kwargs: object
) -> psycopg.AsyncConnection[object]:
    try:
        return await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, **kwargs)  # type: ignore[arg-type]
    except psycopg.OperationalError as exc:
        raise unavailable(dsn, exc) from None
