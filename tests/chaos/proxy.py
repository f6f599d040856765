"""A TCP proxy between one worker and PostgreSQL that can stop forwarding without closing
anything: a network blackhole, as a partition or a dead NAT entry looks to both ends.

It runs in a thread of the harness process. ``blackhole()`` stops moving bytes both ways (and
leaves new connections hanging unanswered); ``heal()`` lets the held bytes through again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self.listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="blackhole-proxy", daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        # A connection made during a blackhole waits, unanswered, like a SYN into the void.
        self._flowing.wait()
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
        peers = {client: server, server: client}
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    # Held, not dropped: TCP would retransmit them once the path heals.
                    self._flowing.wait()
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            for sock in peers:
                with contextlib.suppress(OSError):
                    sock.close()
