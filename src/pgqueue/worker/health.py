"""The worker's liveness, for a supervisor's probe: an HTTP endpoint and/or a file touched on
every heartbeat.

Alive means the heartbeat is recent: its last successful round (the lease it extends is what
keeps this worker's jobs its own) is at most ``STALE_AFTER`` intervals old, and the worker is
not stopping. One failed round is tolerated (a heartbeat round takes up to an interval to time
out, then pauses an interval); two in a row are not. A stalled event loop stops the heartbeat
too, so it also turns the answer to 503, though the server runs in a thread of its own (stdlib
``http.server``: no dependency, and it answers while the loop is stuck, instead of timing out).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

log = logging.getLogger("pgqueue.worker.health")

#: Heartbeat intervals without a successful round after which the worker counts as not alive.
STALE_AFTER = 3.0
#: Paths the endpoint answers (any other is 404).
PATHS = ("/", "/healthz", "/livez")


class Liveness:
    """What the probe reads, written by the worker's loop and read from the server's thread
    (plain attribute reads and writes: no lock needed)."""

    def __init__(self, interval: float, health_file: str | os.PathLike[str] | None) -> None:
        self.interval = interval
        self.file = Path(health_file) if health_file is not None else None
        #: Monotonic time of the last successful heartbeat (0: none yet).
        self.last_beat = 0.0
        self.stopping = False
        self._file_failed = False

    def beat(self) -> None:
        """A heartbeat round succeeded."""
        self.last_beat = time.monotonic()
        if self.file is not None:
            try:
                self.file.touch()
            except OSError as exc:
                if not self._file_failed:  # once: a probe fails anyway, the log need not flood
                    log.warning("could not touch the health file %s: %s", self.file, exc)
                self._file_failed = True
            else:
                self._file_failed = False

    def stop(self) -> None:
        self.stopping = True
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.unlink()

    def status(self) -> tuple[bool, dict[str, Any]]:
        if self.last_beat == 0.0:
            return False, {"status": "starting"}
        age = time.monotonic() - self.last_beat
        body: dict[str, Any] = {"last_heartbeat_seconds_ago": round(age, 3)}
        if self.stopping:
            return False, {"status": "stopping", **body}
        if age > STALE_AFTER * self.interval:
            return False, {"status": "heartbeat stalled", **body}
        return True, {"status": "ok", **body}


class HealthServer:
    """``GET /healthz``: 200 while ``liveness`` says alive, else 503; JSON, never cached."""

    def __init__(self, liveness: Liveness, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"liveness": liveness})
        try:
            self.server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve health on {host}:{port}: {exc}") from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="pgqueue-health", daemon=True
        )

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self.server.server_address[1])

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    liveness: Liveness

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        if self.path.split("?", 1)[0] not in PATHS:
            code, payload = 404, b'{"status": "not found"}'
        else:
            alive, status = self.liveness.status()
            code, payload = (200 if alive else 503), json.dumps(status).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: not worth a line each."""
