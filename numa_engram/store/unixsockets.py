"""Unix sockets the library listens at and connects to: who is at the
other end, and a path freed of the socket a dead listener left."""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import Literal

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(creds)
    return pid, uid, gid


def free_socket_path(path: str) -> Literal["free", "not a socket", "in use"]:
    """Whether a listener may bind ``path``: "free" when nothing is there
    or a socket no one answers at (a dead listener's, removed here); "not a
    socket" or "in use" (a live listener) when it may not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "free"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a dead listener's socket
        return "free"
    finally:
        probe.close()
    return "in use"
