"""Starts and stops everything ``pgqueue demo`` runs.

The order matters for a clean Ctrl-C: PostgreSQL first, then the worker and dashboard
processes, then (in this process) the producers and the progress line. Stopping goes the other
way: producers stop, workers get SIGTERM and finish their running jobs, the dashboard stops,
and only then is the throwaway PostgreSQL stopped and its directory removed.

The children run in their own sessions, so a Ctrl-C in the terminal reaches this process only
and each child gets exactly one SIGTERM from us (a second signal would make a worker exit at
once). On Linux they also get SIGTERM if this process dies without cleaning up.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import IO, Any

from .. import db
from ..embedded import LocalPostgres, PgserverPostgres, free_port, start_throwaway
from ..errors import ConfigurationError
from ..migrate import migrate

#: Schema of the demo's tables in a database you gave it, so its jobs never mix with yours.
OWN_DATABASE_SCHEMA = "pgqueue_demo"
WORKERS = 2
CONCURRENCY = 8
GRACE_PERIOD = 5.0
STARTUP_TIMEOUT = 90.0
TASKS_APP = "pgqueue.demo.tasks:app"
VENDOR = Path(__file__).resolve().parent.parent / "dashboard" / "static" / "vendor"


class DemoError(ConfigurationError):
    """The demo could not start; the message says which part and why."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Output:
    """The progress line: rewritten in place on a terminal, one line every few seconds in a log
    (so that a CI log or a pipe does not fill up with carriage returns)."""

    stream: IO[str]
    interactive: bool
    every: float = 5.0
    _last: float = 0.0
    _open_line: bool = False

    def say(self, text: str) -> None:
        self._end_line()
        print(text, file=self.stream, flush=True)

    def progress(self, text: str) -> None:
        if self.interactive:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
            self._open_line = True
        elif time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            print(text, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False


@dataclass
class Demo:
    dsn: str | None
    schema: str | None
    port: int
    backend: str
    out: Output
    server: LocalPostgres | PgserverPostgres | None = None
    children: list[Child] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pgqueue-demo-")))

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            url = self._start()
            return asyncio.run(self._live(url))
        except KeyboardInterrupt:
            return 0
        finally:
            self._stop()
            signal.signal(signal.SIGTERM, previous)

    # --- start ----------------------------------------------------------------------------

    def _start(self) -> str:
        for module in ("starlette", "uvicorn", "jinja2"):
            if importlib.util.find_spec(module) is None:
                raise DemoError(
                    "the demo shows the dashboard, which needs its extra: "
                    "pip install 'pgqueue-jobs[dashboard]'"
                )
        if self.dsn is None:
            self.out.say("Starting a throwaway PostgreSQL ...")
            self.server = start_throwaway(self.backend)
            self.dsn = self.server.dsn
            self.schema = self.schema or "public"
            self.out.say(f"  {self.server.describe()} (removed on Ctrl-C)")
        else:
            self.schema = self.schema or OWN_DATABASE_SCHEMA
            self.out.say(
                f"Using your database at {db.describe_dsn(self.dsn)}, schema {self.schema} "
                "(kept after the demo)"
            )
        with db.connect(self.dsn) as conn:
            migrate(conn, self.schema)
        env = {
            **os.environ,
            "PGQUEUE_DSN": self.dsn,  # not on the command line, where ps would show it
            "PGQUEUE_DEMO_SCHEMA": self.schema,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("DATABASE_URL", None)
        for number in range(1, WORKERS + 1):
            self._spawn(
                f"worker {number}",
                ["worker", "--app", TASKS_APP, "--schema", self.schema,
                 "--concurrency", str(CONCURRENCY), "--grace-period", str(GRACE_PERIOD),
                 "--log-level", "WARNING"],
                env,
            )  # fmt: skip
        port = self.port if _port_is_free(self.port) else free_port()
        if port != self.port:
            self.out.say(f"  port {self.port} is taken; the dashboard uses {port} instead")
        self._spawn("dashboard", ["dashboard", "--port", str(port), "--schema", self.schema], env)
        url = f"http://127.0.0.1:{port}/"
        self._wait_for_dashboard(url)
        return url

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = self.workdir / f"{name.replace(' ', '-')}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pgqueue.cli", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        self.children.append(Child(name, proc, log))

    def _wait_for_dashboard(self, url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            for child in self.children:
                if child.proc.poll() is not None:
                    raise DemoError(
                        f"{child.name} exited with status {child.proc.returncode}:\n{child.tail()}"
                    )
            try:
                with urllib.request.urlopen(url + "health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"the dashboard did not come up within {STARTUP_TIMEOUT:g} s")
            time.sleep(0.2)

    # --- run ------------------------------------------------------------------------------

    async def _live(self, url: str) -> int:
        assert self.dsn is not None and self.schema is not None
        os.environ["PGQUEUE_DEMO_SCHEMA"] = self.schema
        tasks = importlib.import_module("pgqueue.demo.tasks")
        tasks.app.dsn = self.dsn
        if not (VENDOR / "uPlot.iife.min.js").exists():
            self.out.say(
                "  note: the chart library is missing (run `make assets`); charts stay empty"
            )
        self.out.say(f"Dashboard: {url}")
        self.out.say(
            f"Running: producers, {WORKERS} workers ({CONCURRENCY} jobs at once each), the "
            "dashboard, and a schedule every 10 s. Ctrl-C stops everything."
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        started = time.monotonic()
        status = 0
        producer = asyncio.create_task(produce(tasks, stop))
        try:
            conn = await db.connect_async(self.dsn)
            async with conn:
                while not stop.is_set():
                    dead = [c for c in self.children if c.proc.poll() is not None]
                    if dead:
                        child = dead[0]
                        self.out.say(
                            f"{child.name} exited with status {child.proc.returncode}:\n"
                            f"{child.tail()}"
                        )
                        status = 1
                        break
                    if producer.done():
                        producer.result()  # a producer error ends the demo with its message
                    cur = await conn.execute(tasks.app.q.status_counts)
                    counts = _totals(await cur.fetchall())
                    self.out.progress(_progress_line(time.monotonic() - started, counts))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=1.0)
        finally:
            stop.set()
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            await tasks.app.aclose()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        return status

    # --- stop -----------------------------------------------------------------------------

    def _stop(self) -> None:
        # Another Ctrl-C (or SIGTERM) while stopping must not leave the cluster behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if self.children:
                self.out.say(
                    f"Stopping: workers finish their running jobs (at most {GRACE_PERIOD:g} s), "
                    "then the dashboard and PostgreSQL stop ..."
                )
            for child in self.children:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in self.children:
                try:
                    child.proc.wait(GRACE_PERIOD + 20)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
            if self.server is not None:
                self.server.stop()
                self.out.say("Stopped. The throwaway PostgreSQL and its files are gone.")
            elif self.children:
                self.out.say(
                    f"Stopped. The demo's jobs stay in schema {self.schema}; remove them with "
                    f"DROP SCHEMA {self.schema} CASCADE."
                )
            shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


async def produce(tasks: ModuleType, stop: asyncio.Event) -> None:
    """About twenty jobs a second across five queues, and a burst of 400 low-priority
    newsletters every 30 s (one COPY), so queue depth rises and drains on the dashboard."""
    tick = 0
    last_burst = -1e9
    while not stop.is_set():
        tick += 1
        await tasks.send_email.enqueue_async(to=f"user{tick}@example.com", template="welcome")
        if tick % 5 == 0:
            await tasks.send_email.configure(priority=10).enqueue_async(
                to=f"user{tick}@example.com", template="password-reset"
            )
        if tick % 5 == 1:
            await tasks.build_report.enqueue_async(report_id=tick)
            await tasks.charge_card.enqueue_async(
                order_id=tick, amount_cents=random.randint(500, 20_000)
            )
        if tick % 4 == 2:
            await tasks.deliver_webhook.enqueue_async(url=f"https://partner.example/hook/{tick}")
        if tick % 10 == 3:
            await tasks.resize_image.enqueue_async(image_id=tick, sizes=[64, 256, 1024])
        if time.monotonic() - last_burst > 30:
            last_burst = time.monotonic()
            await tasks.app.enqueue_many_async(
                {"task": "send_email", "priority": -1,
                 "args": {"to": f"reader{i}@example.com", "template": "newsletter"}}
                for i in range(400)
            )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.1)


def _totals(rows: list[Any]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for _queue, status, count in rows:
        totals[str(status)] = totals.get(str(status), 0) + int(count)
    return totals


def _progress_line(elapsed: float, counts: dict[str, int]) -> str:
    minutes, seconds = divmod(int(elapsed), 60)
    parts = [f"{name} {counts.get(name, 0):,}"
             for name in ("queued", "running", "retrying", "succeeded", "dead")]  # fmt: skip
    return f"[{minutes:02d}:{seconds:02d}] " + " · ".join(parts) + " · Ctrl-C stops"


def _port_is_free(port: int) -> bool:
    if port == 0:
        return False
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the demo dies, however it dies (Linux only)."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def run_demo(
    *, dsn: str | None, schema: str | None, port: int, backend: str, stream: IO[str] | None = None
) -> int:
    """``pgqueue demo``: returns the exit status."""
    out = stream or sys.stdout
    demo = Demo(dsn, schema, port, backend, Output(out, interactive=out.isatty()))
    return demo.run()
