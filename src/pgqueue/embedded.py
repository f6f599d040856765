"""A throwaway PostgreSQL cluster (initdb + pg_ctl in a temporary directory, on a free port).

Used by the test harness and by ``pgqueue demo``. PostgreSQL refuses to run as root, so as root
the cluster is created and started as the unprivileged ``postgres`` user.
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
from collections.abc import Callable
from pathlib import Path

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

    def __init__(self, bindir: Path | None = None, port: int | None = None) -> None:
        found = bindir or find_bindir()
        if found is None:
            raise ConfigurationError(
                "PostgreSQL server binaries (initdb, pg_ctl) were not found: install PostgreSQL "
                "(e.g. `apt-get install postgresql`) or point PGQUEUE_TEST_DSN / PGQUEUE_DSN "
                "at a running server"
            )
        self.bindir = found
        self.port = port or free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="pgqueue-pg-"))
        self.datadir = self.tmp / "data"
        self.user = "postgres"
        self._run_as: Callable[[], None] | None = None
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise ConfigurationError(
                    "running as root, and PostgreSQL refuses root: create a `postgres` user "
                    "or run as an unprivileged user"
                ) from None
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
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.tmp} "
            "-c max_connections=300 -c shared_buffers=128MB -c fsync=on "
            "-c log_min_messages=warning"
        )
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
        return self

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
