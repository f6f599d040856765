"""A throwaway PostgreSQL cluster (initdb + pg_ctl in a temporary directory, on a free port).

Used by the test harness and by ``pgqueue demo``. PostgreSQL refuses to run as root, so as root
the cluster is created and started as the unprivileged ``postgres`` user.

Where no server binaries are installed, ``pgqueue demo`` falls back to the ``pgserver`` package
(the ``pgqueue-jobs[embedded]`` extra), which ships PostgreSQL's binaries in its wheel.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .errors import ConfigurationError


def find_bindir() -> Path | None:
    """initdb's directory: from PATH, from ``pg_config --bindir``, else /usr/lib/postgresql."""
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedPostgres:
    """Start with ``start()``, stop and delete everything with ``stop()``."""

    def __init__(
        self,
        bindir: Path | None = None,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        found = bindir or find_bindir()
        if found is None:
            raise ConfigurationError(
                "PostgreSQL server binaries (initdb, pg_ctl) were not found: install PostgreSQL "
                "(e.g. `apt-get install postgresql`) or point PGQUEUE_TEST_DSN / PGQUEUE_DSN "
                "at a running server"
            )
        self.bindir = found
        self.port = port or free_port()
        #: Server settings over the defaults below (e.g. ``{"max_connections": "100"}``).
        self.settings = dict(settings or {})
        self.user = "postgres"
        self._run_as: Callable[[], None] | None = None
        pw = None
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise ConfigurationError(
                    "running as root, and PostgreSQL refuses root: create a `postgres` user "
                    "or run as an unprivileged user"
                ) from None
        self.tmp = Path(tempfile.mkdtemp(prefix="pgqueue-pg-"))
        self.datadir = self.tmp / "data"
        if pw is not None:
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            uid, gid = pw.pw_uid, pw.pw_gid

            def demote() -> None:
                os.setgid(gid)
                os.setuid(uid)

            self._run_as = demote
        self.started = False

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            preexec_fn=self._run_as,
            cwd=self.tmp,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{args[0]} failed: {result.stderr.strip() or result.stdout.strip()}"
            )

    def start(self) -> EmbeddedPostgres:
        self._run(
            "initdb",
            "-D",
            str(self.datadir),
            "-U",
            self.user,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        self.start_server()
        return self

    def start_server(self) -> None:
        """Start the server of an initialised cluster (again, after ``stop_server``)."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.tmp} "
            "-c max_connections=300 -c shared_buffers=128MB -c fsync=on "
            "-c log_min_messages=warning"
        )
        for name, value in self.settings.items():  # a later -c wins
            options += f" -c {name}={value}"
        self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-o",
            options,
            "-l",
            str(self.tmp / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )
        self.started = True

    def stop_server(self, mode: str = "fast") -> None:
        """Stop the server and keep its data, as an outage would (``immediate``: a crash)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """Restart in place (``immediate`` simulates a crash)."""
        # -l again: without it the new postmaster would write to (and hold open) our pipes.
        self._run(
            "pg_ctl", "-D", str(self.datadir), "-l", str(self.tmp / "server.log"),
            "-m", mode, "-w", "-t", "60", "restart",
        )  # fmt: skip

    def stop(self) -> None:
        if self.started:
            with contextlib.suppress(RuntimeError):
                self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop")
            self.started = False
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Throwaway(Protocol):
    """What ``pgqueue demo`` needs of a throwaway server: where it is, and how to remove it."""

    @property
    def dsn(self) -> str: ...

    def describe(self) -> str: ...

    def stop(self) -> None: ...


class LocalPostgres:
    """EmbeddedPostgres behind the ``Throwaway`` interface."""

    def __init__(self, cluster: EmbeddedPostgres) -> None:
        self.cluster = cluster

    @property
    def dsn(self) -> str:
        return self.cluster.dsn

    @property
    def path(self) -> Path:
        return self.cluster.tmp

    def describe(self) -> str:
        c = self.cluster
        return f"PostgreSQL from {c.bindir}, data in {c.tmp}, port {c.port}"

    def stop(self) -> None:
        self.cluster.stop()


class PgserverPostgres:
    """The PostgreSQL that the ``pgserver`` package ships, in a temporary directory.

    pgserver listens on a Unix socket only (in the data directory), so the DSN names a socket
    directory rather than a port. As root it runs the server as a ``pgserver`` system user,
    which it creates with ``useradd`` the first time.
    """

    def __init__(self) -> None:
        self.server: Any = None
        self.path = Path(tempfile.mkdtemp(prefix="pgqueue-pgserver-"))

    def start(self) -> PgserverPostgres:
        pgserver = import_pgserver()
        if pgserver is None:
            shutil.rmtree(self.path, ignore_errors=True)
            raise ConfigurationError(
                "the pgserver package is not installed: pip install 'pgqueue-jobs[embedded]'"
            )
        try:
            self.server = pgserver.get_server(self.path, cleanup_mode="delete")
        except Exception as exc:
            shutil.rmtree(self.path, ignore_errors=True)
            raise RuntimeError(f"pgserver could not start PostgreSQL: {exc}") from exc
        return self

    @property
    def dsn(self) -> str:
        assert self.server is not None, "start() first"
        return str(self.server.get_uri())

    def describe(self) -> str:
        return f"PostgreSQL from the pgserver package, data and socket in {self.path}"

    def stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.cleanup()
            self.server = None
        shutil.rmtree(self.path, ignore_errors=True)


def import_pgserver() -> Any:
    """The pgserver module, or None. platformdirs warns at import when $XDG_RUNTIME_DIR is
    unset (common in containers); that is harmless here, so it is not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            return None
    return pgserver


BACKENDS = ("auto", "local", "pgserver")


def start_throwaway(backend: str = "auto") -> LocalPostgres | PgserverPostgres:
    """Start a throwaway server: the local binaries when they are installed (and usable), else
    pgserver's. ``backend`` forces one of them."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"unknown PostgreSQL backend {backend!r}: use one of {BACKENDS}")
    local_problem = None
    if backend in ("auto", "local"):
        try:
            cluster = EmbeddedPostgres()
        except ConfigurationError as exc:
            if backend == "local":
                raise
            local_problem = str(exc)
        else:
            try:
                return LocalPostgres(cluster.start())
            except BaseException:
                cluster.stop()
                raise
    if import_pgserver() is None:
        raise ConfigurationError(
            f"{local_problem or 'no local PostgreSQL'}; nor is the pgserver package installed "
            "(pip install 'pgqueue-jobs[embedded]', which ships PostgreSQL). Or give a database: "
            "--dsn or $PGQUEUE_DSN"
        )
    return PgserverPostgres().start()
