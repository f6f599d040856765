"""Adapter processes, throwaway databases and CPU accounting for the benchmark runner."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import conninfo, sql

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads), 0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_steal_counters() -> tuple[int, int] | None:
    """(steal, total) ticks of all CPUs since boot, from /proc/stat; None where there is none.
    Steal is time the hypervisor gave this virtual machine's cores to someone else."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields)) if len(fields) > 7 else None


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def children_of(parent: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry.name))
    return pids


@dataclass
class CpuMeter:
    """CPU of PostgreSQL (postmaster and all its children) and of the adapter processes.

    Backends that exit between two readings take their CPU with them, so readings are taken while
    the processes under test are still connected. ``postmaster`` is None when the server is not on
    this machine (or not visible): PostgreSQL CPU is then not reported.
    """

    postmaster: int | None
    seen: dict[int, float] = field(default_factory=dict)

    def postgres(self, exclude: int | None = None) -> float | None:
        """PostgreSQL's CPU, less the backend ``exclude`` (the runner's own poll connection)."""
        if self.postmaster is None:
            return None
        pids = [self.postmaster, *children_of(self.postmaster)]
        return sum(cpu_seconds(pid) for pid in pids if pid != exclude)

    @staticmethod
    def processes(pids: Sequence[int]) -> float:
        return sum(cpu_seconds(pid) for pid in pids)


def find_postmaster(dsn: str) -> int | None:
    """The postmaster's pid: the parent of our backend, read while that backend still exists
    (once the connection closes it may be gone, and PostgreSQL CPU would go unreported)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        try:
            stat = Path(f"/proc/{row[0]}/stat").read_text().rsplit(")", 1)[1].split()
            comm = Path(f"/proc/{stat[1]}/comm").read_text().strip()
        except (OSError, IndexError):
            return None
    return int(stat[1]) if comm.startswith("postgres") else None


class Databases:
    """Creates one throwaway database per run and drops it afterwards."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.prefix = f"pgqueue_bench_{uuid.uuid4().hex[:8]}"
        self.count = 0

    def dsn(self, name: str) -> str:
        """A URL (asyncpg, which one peer uses, takes no key=value DSNs)."""
        parts = conninfo.conninfo_to_dict(self.admin_dsn)
        user = quote(str(parts.get("user") or getpass.getuser()), safe="")
        password = parts.get("password")
        auth = f"{user}:{quote(str(password), safe='')}@" if password else f"{user}@"
        host = str(parts.get("host") or "127.0.0.1")
        port = parts.get("port") or 5432
        return f"postgresql://{auth}{host}:{port}/{quote(name, safe='')}"

    @contextlib.contextmanager
    def fresh(self) -> Any:
        self.count += 1
        name = f"{self.prefix}_{self.count}"
        ident = sql.Identifier(name)
        with psycopg.connect(self.admin_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(ident))
        try:
            yield self.dsn(name)
        finally:
            with psycopg.connect(self.admin_dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))

    def settings(self) -> dict[str, str]:
        names = ["server_version", "fsync", "synchronous_commit", "wal_sync_method",
                 "shared_buffers", "max_connections"]  # fmt: skip
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            return {n: str(conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(n))).fetchone()[0])  # type: ignore[index]
                    for n in names}  # fmt: skip


class AdapterError(RuntimeError):
    pass


@dataclass
class System:
    """One configuration of one system: how to start its adapter and what to pass it."""

    key: str  # e.g. "pgqueuer-b100": unique per configuration
    label: str  # what the table shows
    family: str  # "pgqueue", "pgqueuer", "procrastinate": for "best peer" figures
    argv: list[str]  # the adapter command, the role follows
    env: dict[str, str] = field(default_factory=dict)
    work_config: dict[str, Any] = field(default_factory=dict)
    #: Fraction of the job counts this system gets (a slow peer need not drain 50,000 jobs to
    #: show its rate; its rate is measured over the same middle 90 % of its own run).
    scale: float = 1.0
    #: Statements run right after ``install`` (e.g. to switch a trigger off for a variant).
    after_install: list[str] = field(default_factory=list)
    #: Statements run on a session that stays open while the enqueue workloads run (e.g. to hold
    #: the lock by which a waiting worker asks producers to notify).
    session: list[str] = field(default_factory=list)
    #: Only these workloads (empty: all that apply).
    workloads: set[str] = field(default_factory=set)
    version: str = ""
    remaining_sql: str = ""


class Adapter:
    """A running adapter process; stdout lines are JSON, stderr goes to a log file."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str, log: Path) -> None:
        self.proc = proc
        self.role = role
        self.log = log
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            text = raw.decode().strip()
            if text.startswith("{"):
                await self.lines.put(json.loads(text))

    async def next(self, timeout: float = 120.0) -> dict[str, Any]:
        getter = asyncio.ensure_future(self.lines.get())
        done, _ = await asyncio.wait(
            {getter, self._reader}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if getter in done:
            return getter.result()
        getter.cancel()
        if not done:
            raise AdapterError(f"{self.role}: no answer within {timeout:g} s (log: {self.log})")
        await self.proc.wait()
        tail = self.log.read_text()[-2000:] if self.log.exists() else ""
        raise AdapterError(
            f"{self.role} exited with status {self.proc.returncode} (log: {self.log})\n{tail}"
        )

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self, timeout: float = 120.0) -> dict[str, Any]:
        """The last JSON line, after the process exited cleanly."""
        result: dict[str, Any] = {}
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
            raise AdapterError(f"{self.role}: did not exit within {timeout:g} s ({self.log})")
        await self._reader
        while not self.lines.empty():
            result = self.lines.get_nowait()
        if self.proc.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise AdapterError(f"{self.role} failed ({self.log}):\n{tail}")
        return result

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


#: The longest JSON line an adapter may print: a worker's report carries its starts or its pickup
#: histogram (long_tx: a few kB per second of the run), far beyond asyncio's default of 64 KiB.
LINE_LIMIT = 256 * 2**20


@contextlib.asynccontextmanager
async def adapter(
    system: System, role: str, dsn: str, args: Sequence[str], logdir: Path
) -> AsyncIterator[Adapter]:
    log = logdir / f"{system.key}-{role}.log"
    with log.open("ab") as err:
        proc = await asyncio.create_subprocess_exec(
            *system.argv, role, "--dsn", dsn, *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
            env={**os.environ, **system.env}, limit=LINE_LIMIT,
        )  # fmt: skip
    running = Adapter(proc, f"{system.label} {role}", log)
    try:
        yield running
    finally:
        running.kill()
        await proc.wait()


async def run_role(
    system: System, role: str, dsn: str, args: Sequence[str], logdir: Path, timeout: float = 600
) -> dict[str, Any]:
    async with adapter(system, role, dsn, args, logdir) as proc:
        if proc.proc.stdin is not None:
            proc.proc.stdin.close()
        return await proc.finish(timeout)
