"""systemd's notify protocol and file descriptor store, spoken directly
(no libsystemd): a datagram to ``$NOTIFY_SOCKET`` with the descriptors
attached (``FDSTORE=1``, ``FDNAME=``, ``READY=1``), and on start the
descriptors systemd passes back (``LISTEN_PID``, ``LISTEN_FDS``,
``LISTEN_FDNAMES``; descriptors from 3 up), as sd_notify(3) and
sd_listen_fds(3) describe them.  A notify that fails is logged and
dropped, and one waits NOTIFY_TIMEOUT_S at most for room in the manager's
queue: the service manager being away, or too busy to read, never takes
the tables down nor holds up their load."""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
from collections.abc import Sequence

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3
# A full queue (a manager that does not read) blocks a datagram send for
# good; a notify waits this long for room, then is dropped with a warning.
NOTIFY_TIMEOUT_S = 1.0


def notify(message: str, fds: Sequence[int] = ()) -> bool:
    """Send ``message`` (newline-separated assignments) with ``fds`` to the
    service manager; False when not run under one (no NOTIFY_SOCKET) or
    when the send failed or found no room in NOTIFY_TIMEOUT_S (logged)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        ancillary = []
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        # Connected, so that waiting for room polls the peer's queue (an
        # unconnected datagram socket always polls writable).
        sock.settimeout(NOTIFY_TIMEOUT_S)
        sock.connect(address)
        sock.sendmsg([message.encode()], ancillary)
    except OSError as exc:
        why = f"no room in its queue for {NOTIFY_TIMEOUT_S:g} s" \
            if isinstance(exc, TimeoutError) else exc.strerror or exc
        log.warning("sd_notify to %r failed (%s): %r not delivered; serving on",
                    os.environ.get("NOTIFY_SOCKET"), why, message)
        return False
    finally:
        sock.close()
    return True


def listen_fds(unset: bool = True) -> list[tuple[str, int]]:
    """The descriptors passed to this process, as (name, fd) pairs in order
    (``fdN`` where the manager gave no name; a name may come twice); []
    when they are not for this process.  A descriptor the count names but
    that is not open is skipped with a warning.  ``unset`` clears the
    variables so children do not take them as theirs."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    if unset:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
    if pid != os.getpid() or count < 1:
        return []
    out = []
    for i in range(count):
        fd = LISTEN_FDS_START + i
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)  # ours now: not for children
        except OSError:
            log.warning("LISTEN_FDS=%d names fd %d, which is not open: skipped (the service "
                        "manager passed fewer descriptors than it said)", count, fd)
            continue
        name = names[i] if i < len(names) and names[i] else f"fd{fd}"
        out.append((name, fd))
    return out
