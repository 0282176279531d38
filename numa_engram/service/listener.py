"""The table service's connections: one thread per connection, at most
``max_connections`` at once (the oldest is shed for a new one), and a
descriptor held in reserve so that running out of descriptors sheds a
connection instead of spinning in ``accept`` (EMFILE leaves the connection
queued, so the listener would be readable for ever)."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
ACCEPT_POLL_S = 0.2  # how soon stop() is noticed; the only wake-ups of an idle service


def connection_cap(limit: int = MAX_CONNECTIONS) -> int:
    """At most a quarter of this process's descriptor limit (tables, the
    checkpoint's files and the loaders need the rest), at least 4."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(4, min(limit, soft // 4))


class Listener:
    """Accepts on a bound, listening Unix ``sock`` and runs ``handle(conn)``
    per connection in its own thread (which closes ``conn`` after)."""

    def __init__(self, sock: socket.socket, handle: Callable[[socket.socket], None],
                 max_connections: int | None = None) -> None:
        self.sock, self.handle = sock, handle
        self.max_connections = max_connections or connection_cap()
        self._open: dict[socket.socket, float] = {}  # connection -> when accepted
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reserve = _reserve()
        self.shed = 0  # connections closed to make room

    def serve_forever(self) -> None:
        self.sock.settimeout(ACCEPT_POLL_S)
        while not self._stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopped.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors()
                else:
                    log.warning("table service: accept failed: %s", exc)
                    time.sleep(ACCEPT_POLL_S)
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            if len(self._open) >= self.max_connections:
                self._shed_oldest()
            self._open[conn] = time.monotonic()
        threading.Thread(target=self._run, args=(conn,), name="engram-service-conn",
                         daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handle(conn)
        except Exception as exc:  # one connection's failure ends it alone
            log.warning("table service: a connection failed: %s", exc)
        finally:
            with self._lock:
                self._open.pop(conn, None)
            conn.close()

    def _shed_oldest(self) -> None:
        """(Under the lock.)  Wake the oldest connection's thread with a
        shutdown; it closes its own socket."""
        oldest = min(self._open, key=self._open.__getitem__)
        del self._open[oldest]
        try:
            oldest.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.shed += 1

    def _out_of_descriptors(self) -> None:
        """The reserve descriptor makes room to accept and close the queued
        connection; the oldest open one goes too, so the next fits."""
        log.warning("table service: out of descriptors (RLIMIT_NOFILE) with %d connections "
                    "open: shedding", len(self._open))
        if self._reserve >= 0:
            os.close(self._reserve)
            self._reserve = -1
        try:
            conn, _ = self.sock.accept()
            conn.close()
        except OSError:
            time.sleep(0.01)  # nothing could be freed this time: never spin
        with self._lock:
            if self._open:
                self._shed_oldest()
        self._reserve = _reserve()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            for conn in list(self._open):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._reserve >= 0:
            os.close(self._reserve)
            self._reserve = -1

    @property
    def open_connections(self) -> int:
        return len(self._open)


def _reserve() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
