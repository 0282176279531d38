"""Unix sockets the library listens at and connects to: who is at the
other end, and a path freed of the socket a dead listener left."""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import Literal

from ..errors import StorageError

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(creds)
    return pid, uid, gid


def free_socket_path(path: str) -> Literal["free", "not a socket", "in use"]:
    """Whether a listener may bind ``path``: "free" when nothing is there
    or a socket no one answers at (a dead listener's, removed here); "not a
    socket" or "in use" (a live listener) when it may not.  A socket this
    user may neither probe nor remove (another user's) is a StorageError
    naming its owner."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "free"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    if answers(path, st.st_uid):
        return "in use"
    _remove_dead(path, st.st_uid)
    return "free"


def answers(path: str, owner: int) -> bool:
    """Whether a listener answers at the socket ``path`` (of uid
    ``owner``), nothing removed: a StorageError where this user may not
    connect to it (another user's), so cannot tell."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a live listener with a full queue answers EAGAIN, not a wait
    try:
        probe.connect(path)
    except PermissionError:
        raise StorageError(f"{path!r} is a socket of uid {owner} that this user (uid "
                           f"{os.getuid()}) may not connect to, so cannot tell whether it is "
                           f"in use: remove it as its owner, or choose another path") from None
    except BlockingIOError:
        return True  # listening, its queue full
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _remove_dead(path: str, owner: int) -> None:
    """Remove a socket nobody listens at (a dead listener's)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # another process removed it first
    except PermissionError:
        raise StorageError(f"{path!r} is a dead listener's socket of uid {owner}, which this "
                           f"user (uid {os.getuid()}) may not remove: remove it as its owner "
                           f"(or root), or choose another path") from None
