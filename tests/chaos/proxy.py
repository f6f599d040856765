"""A TCP proxy between one worker and PostgreSQL that can stop forwarding without closing
anything: a network blackhole, as a partition or a dead NAT entry looks to both ends.

It runs in a thread of the harness process. ``blackhole()`` stops moving bytes both ways (and
leaves new connections hanging unanswered); ``heal()`` lets the held bytes through again.
``cut_after_next_execute()`` cuts at a chosen point of a conversation: it lets the client's
next statement through (its Execute message), then blackholes; the Sync that ends it goes too
only if it came in the same bytes, as when libpq sends a statement alone (Parse, Bind,
Execute, Sync in one write). A pipeline's next statement or Sync, or a transaction's COMMIT, is
held: the server has run the statement and waits for what comes next.
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
        self._cut_next = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="blackhole-proxy", daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self._flowing.clear()

    def cut_after_next_execute(self) -> None:
        self._cut_next.set()

    @property
    def holding(self) -> bool:
        """Whether bytes are held now (a blackhole, or the cut after a write, has begun)."""
        return not self._flowing.is_set()

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
                    if sock is client and self._cut_next.is_set():
                        end = _through_execute(data)
                        if end is not None:
                            self._cut_next.clear()
                            self._flowing.clear()
                            peers[sock].sendall(data[:end])
                            data = data[end:]
                            self._flowing.wait()
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            for sock in peers:
                with contextlib.suppress(OSError):
                    sock.close()


def _through_execute(data: bytes) -> int | None:
    """Where the first Execute message in ``data`` ends, or the Sync right after it if that
    follows in ``data`` (frontend messages: a type byte, then a length that counts itself);
    None without an Execute. ``data`` starts at a message boundary: the client waits between
    its conversations, and the cut is armed between them."""
    at = 0
    while at + 5 <= len(data):
        kind, length = data[at : at + 1], int.from_bytes(data[at + 1 : at + 5], "big")
        at += 1 + length
        if kind == b"E":
            if data[at : at + 1] == b"S":
                at += 5
            return min(at, len(data))
    return None
