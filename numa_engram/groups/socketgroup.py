"""SocketGroup: a sharing group of processes on one host that meet at a
Unix socket, with no torch.distributed (a serving stack without a gloo
group, or a process that must not import torch).

The leader (rank 0) listens at ``path`` until every member has joined,
then removes it; each collective goes through the leader (a star: a
group is one host's replicas exchanging kilobytes).  A member that dies
closes its connection, so the others learn it at once; one that is
stopped or hung is named when the step's timeout runs out.  Either
breaks the group, as a timed-out gloo group is broken: make a new one.

Collectives carry pickles, so a member reads nothing from a process of
another user: the leader checks each peer's credentials (SO_PEERCRED)
before it reads a byte, and each peer checks the leader's.  Root may
join a user's group; a user may not join root's.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import pickle
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from ..errors import GroupTimeout, NumaEngramError, TopologyError
from ..store.unixsockets import free_socket_path, peer_uid
from .group import Members

log = logging.getLogger(__name__)

_HELLO = struct.Struct("!4sII")  # magic, rank, size: read before any pickle
_MAGIC = b"NEG1"
_LENGTH = struct.Struct("!Q")
MAX_MESSAGE = 64 << 20  # the protocol's messages are kilobytes
_RETRY_S = 0.01
_HELLO_S = 5.0  # a connection that says nothing holds the leader this long, at most
_MAX_PATH = 108  # sizeof(sockaddr_un.sun_path), the terminating NUL included
# a member waits this long past its bound for the leader's word, so that
# when a third member is missing it hears which one from the leader
_GRACE_S = 1.0


class SocketGroup(Members):
    """Member ``rank`` of ``size`` processes meeting at the Unix socket
    ``path`` (every member passes the same path; one path per group).
    ``ranks``: the members' world ranks, in group order (default
    ``range(size)``), used in messages.  Joining and every collective are
    bounded by ``timeout_s``; ``bounded(t)`` sets another bound inside."""

    def __init__(self, path: str | os.PathLike[str], rank: int, size: int, *,
                 ranks: Sequence[int] | None = None, timeout_s: float = 300.0,
                 identity: str = "") -> None:
        rank, size, members, timeout_s, self.path = _checked(path, rank, size, ranks, timeout_s,
                                                             identity)
        super().__init__(rank, size, members, timeout_s, identity)
        self._peers: dict[int, socket.socket] = {}  # the leader's: group rank -> connection
        self._leader: socket.socket | None = None
        self._broken: str | None = None
        self._calls = 0
        if size > 1:
            deadline = time.monotonic() + self.timeout_s
            self._listen(deadline) if rank == 0 else self._connect(deadline)

    # ------------------------------------------------------ Group surface --
    @property
    def process_group(self) -> None:
        return None  # no torch ProcessGroup behind it

    def broadcast(self, obj: Any, step: str) -> Any:
        if self._size == 1:
            return obj
        return self._collective(step, obj, gather=False)

    def all_gather(self, obj: Any, step: str) -> list[Any]:
        if self._size == 1:
            return [obj]
        return self._collective(step, obj, gather=True)

    def barrier(self, step: str) -> None:
        self.all_gather(None, step)

    def close(self) -> None:
        """Close the connections (the others' next collective fails)."""
        for sock in [*self._peers.values(), *([self._leader] if self._leader else [])]:
            sock.close()
        self._peers.clear()
        self._leader = None
        self._broken = self._broken or "closed"

    def __enter__(self) -> SocketGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- join --
    def _listen(self, deadline: float) -> None:
        """Accept every member at ``path`` (each checked, a wrong one told
        why), tell them all the group is whole (or why it is not), then
        remove the path: nothing is left on disk."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = None
        try:
            bound = _bind(server, self.path)
            server.listen(self._size)
            while len(self._peers) < self._size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [self._ranks[r] for r in range(1, self._size)
                               if r not in self._peers]
                    raise GroupTimeout(
                        f"forming the group at {self.path}: member(s) at world rank(s) "
                        f"{missing} did not join within {self.timeout_s:.0f} s")
                if select.select([server], [], [], left)[0]:
                    self._admit(server.accept()[0], deadline)
            for r, sock in self._peers.items():
                try:
                    _send_frame(sock, b"ok", deadline)
                except (OSError, GroupTimeout):
                    raise GroupTimeout(f"forming the group at {self.path}: the member at "
                                       f"world rank {self._ranks[r]} left before it was "
                                       f"whole") from None
        except BaseException as exc:
            kind = b"timeout" if isinstance(exc, GroupTimeout) else b"refused"
            for sock in self._peers.values():
                _refuse(sock, str(exc) or type(exc).__name__, kind)
            self._peers.clear()
            raise
        finally:
            server.close()
            if bound is not None:
                _unlink_if(self.path, bound)

    def _admit(self, conn: socket.socket, deadline: float) -> None:
        """Take ``conn`` as a member, or refuse it saying why."""
        pid, uid, _ = peer_uid(conn)
        if uid not in (os.getuid(), 0):
            why = (f"the group's leader at {self.path} runs as uid {os.getuid()} and takes no "
                   f"member of uid {uid}: run every member as one user")
            log.warning("refused pid %d (uid %d) at %s: another user", pid, uid, self.path)
            return _refuse(conn, why)
        try:
            hello = _recv_exact(conn, _HELLO.size, min(deadline, time.monotonic() + _HELLO_S))
            magic, rank, size = _HELLO.unpack(hello)
        except (OSError, GroupTimeout, EOFError):
            conn.close()  # it left, or never said who it is
            return None
        if magic != _MAGIC or size != self._size or not 0 < rank < size:
            return _refuse(conn, f"pid {pid} asked to join {self.path} as rank {rank} of "
                           f"{size}; this group has {self._size} members, ranks 1.."
                           f"{self._size - 1} joining")
        if rank in self._peers:
            return _refuse(conn, f"rank {rank} has already joined the group at {self.path} "
                           f"(pid {pid} is a second one): give each member its own rank")
        self._peers[rank] = conn  # told "ok" once every member is in
        return None

    def _connect(self, deadline: float) -> None:
        leader = self._ranks[0]
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)  # a full listen queue: EAGAIN, not a wait past the bound
            try:
                sock.connect(self.path)
                break
            except PermissionError:
                sock.close()
                raise NumaEngramError(
                    f"cannot connect to the group's socket {self.path}: permission denied; "
                    f"every member must reach the leader's socket (run them as one user, "
                    f"the path in a directory they share)") from None
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise GroupTimeout(_no_leader(self.path, leader, self.timeout_s,
                                                  full=isinstance(exc, BlockingIOError))) from None
                time.sleep(_RETRY_S)
        try:
            _, uid, _ = peer_uid(sock)
            if uid not in (os.getuid(), 0):
                raise NumaEngramError(f"the leader at {self.path} runs as uid {uid}, this "
                                      f"member as uid {os.getuid()}: run every member as one "
                                      f"user")
            try:
                _send_all(sock, _HELLO.pack(_MAGIC, self._rank, self._size), deadline)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before it read the hello: the reason is there to read
            reply = _recv_frame(sock, deadline + _GRACE_S)
        except GroupTimeout:
            sock.close()
            raise GroupTimeout(f"the group's leader (world rank {leader}) at {self.path} did "
                               f"not answer within {self.timeout_s:.0f} s") from None
        except (EOFError, OSError) as exc:
            sock.close()
            raise GroupTimeout(f"the group's leader at {self.path} closed the connection while "
                               f"this member joined ({exc or 'end of stream'})") from None
        except BaseException:
            sock.close()
            raise
        if reply != b"ok":
            sock.close()
            kind, _, why = reply.decode(errors="replace").partition(":")
            raise (GroupTimeout if kind == "timeout" else NumaEngramError)(why)
        self._leader = sock

    # -------------------------------------------------------- collectives --
    def _collective(self, step: str, obj: Any, gather: bool) -> Any:
        if self._broken is not None:
            raise GroupTimeout(f"step '{step}': the group at {self.path} is broken "
                               f"({self._broken}); make a new one")
        call, self._calls = self._calls, self._calls + 1
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._rank == 0:
                return self._lead(call, step, obj, gather, deadline)
            return self._follow(call, step, obj, gather, deadline)
        except GroupTimeout as exc:
            self._break(str(exc))
            raise
        except BaseException as exc:
            self._break(f"step '{step}' failed: {type(exc).__name__}: {exc}")
            raise

    def _lead(self, call: int, step: str, obj: Any, gather: bool, deadline: float) -> Any:
        result = obj
        if gather:
            frames = self._gather_frames(step, deadline)
            result = [obj] + [self._payload(frames[r], r, call, step) for r in
                              range(1, self._size)]
        message = pickle.dumps(("data", call, step, result))
        for r, sock in self._peers.items():
            try:
                _send_frame(sock, message, deadline)
            except GroupTimeout:
                raise self._timeout(step, [r], "did not take the step's result") from None
            except OSError:
                raise GroupTimeout(self._gone(step, r)) from None
        return result

    def _follow(self, call: int, step: str, obj: Any, gather: bool, deadline: float) -> Any:
        assert self._leader is not None
        leader = self._ranks[0]
        try:
            if gather:
                try:
                    _send_frame(self._leader, pickle.dumps(("data", call, step, obj)), deadline)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the leader broke the group first: its reason is there to read
            frame = _recv_frame(self._leader, deadline + _GRACE_S)
        except GroupTimeout:
            raise GroupTimeout(
                f"step '{step}': the sharing group {list(self._ranks)} did not complete within "
                f"{self.timeout_s:.0f} s: the leader (world rank {leader}) did not answer "
                f"(it, or a member it waits for, is stopped, hung or slow)") from None
        except (EOFError, OSError):
            raise GroupTimeout(f"step '{step}': the leader (world rank {leader}) of the "
                               f"sharing group {list(self._ranks)} closed the group: it "
                               f"exited or died") from None
        return self._payload(frame, 0, call, step)

    def _gather_frames(self, step: str, deadline: float) -> dict[int, bytes]:
        """One frame from every member, whichever comes first; a member
        that closes is named at once, the ones missing at the deadline then."""
        readers = {sock: _FrameReader() for sock in self._peers.values()}
        by_sock = {sock: r for r, sock in self._peers.items()}
        frames: dict[int, bytes] = {}
        while len(frames) < len(self._peers):
            pending = [s for s in readers if by_sock[s] not in frames]
            left = deadline - time.monotonic()
            ready = select.select(pending, [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                raise self._timeout(step, [by_sock[s] for s in pending], "did not arrive")
            for sock in ready:
                try:
                    frame = readers[sock].read(sock)
                except (EOFError, OSError):
                    raise GroupTimeout(self._gone(step, by_sock[sock])) from None
                if frame is not None:
                    frames[by_sock[sock]] = frame
        return frames

    def _payload(self, frame: bytes, member: int, call: int, step: str) -> Any:
        kind, their_call, their_step, payload = pickle.loads(frame)
        if kind == "abort":
            raise GroupTimeout(payload)
        if (their_call, their_step) != (call, step):
            raise NumaEngramError(
                f"step '{step}': the member at world rank {self._ranks[member]} is at step "
                f"'{their_step}' (collective {their_call}, this member's {call}): the members "
                f"do not run the same protocol")
        return payload

    def _timeout(self, step: str, members: Sequence[int], what: str) -> GroupTimeout:
        return GroupTimeout(
            f"step '{step}': the sharing group {list(self._ranks)} did not complete within "
            f"{self.timeout_s:.0f} s; member(s) at world rank(s) "
            f"{[self._ranks[r] for r in members]} {what} (stopped, hung or slow)")

    def _gone(self, step: str, member: int) -> str:
        return (f"step '{step}': the member at world rank {self._ranks[member]} of the sharing "
                f"group {list(self._ranks)} closed its connection: it exited or died")

    def _break(self, why: str) -> None:
        """Broken: the leader tells the members why before closing."""
        if self._rank == 0:
            message = pickle.dumps(("abort", -1, "", why))
            for sock in self._peers.values():
                try:
                    _send_frame(sock, message, time.monotonic() + 1.0)
                except (OSError, GroupTimeout):
                    pass  # that one is gone or stopped: its own wait tells it
        self.close()
        self._broken = why


def _checked(path: Any, rank: Any, size: Any, ranks: Any, timeout_s: Any, identity: Any
             ) -> tuple[int, int, tuple[int, ...], float, str]:
    """The constructor's arguments, each one wrong refused naming it:
    (rank, size, ranks, timeout_s, path)."""
    try:
        rank, size = operator.index(rank), operator.index(size)
    except TypeError:
        raise TopologyError(f"rank {rank!r} and size {size!r} must be integers") from None
    if size < 1 or not 0 <= rank < size:
        raise TopologyError(f"rank {rank} of size {size}: need size >= 1 and 0 <= rank < size")
    try:
        members = tuple(operator.index(r) for r in (range(size) if ranks is None else ranks))
    except TypeError:
        raise TopologyError(f"ranks {ranks!r} must be a sequence of {size} distinct integer "
                            f"world ranks") from None
    if len(members) != size or len(set(members)) != size:
        raise TopologyError(f"ranks {list(members)} must be {size} distinct world ranks")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise TopologyError(f"timeout_s {timeout_s!r} must be a finite number of seconds above "
                            f"0: every join and collective of the group is bounded by it")
    if not isinstance(identity, str):
        raise TopologyError(f"identity {identity!r} must be a str")
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TopologyError(f"the group's path {path!r} must be a str or a path-like of one")
    text = os.fspath(path)
    if not text or "\0" in text:
        raise TopologyError(f"the group's path {text!r} must be a non-empty path without NUL")
    if len(os.fsencode(text)) >= _MAX_PATH:
        raise TopologyError(f"the group's path {text!r} is {len(os.fsencode(text))} "
                            f"bytes; a Unix socket's path has at most {_MAX_PATH - 1}: "
                            f"choose a shorter directory")
    return rank, size, members, float(timeout_s), text


def _no_leader(path: str, leader: int, timeout_s: float, full: bool) -> str:
    if full:
        return (f"the group's leader (world rank {leader}) at {path!r} took no connection within "
                f"{timeout_s:.0f} s: its listen queue is full (it is stopped, hung or slow)")
    return (f"no leader (world rank {leader}) listened at {path} within {timeout_s:.0f} s (it "
            f"has not come, or its group was whole without this member and the path is gone)")


class _FrameReader:
    """A length-prefixed frame read in pieces as they come."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def read(self, sock: socket.socket) -> bytes | None:
        """Read what is there; the frame once whole, else None."""
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise EOFError
        self._buf += chunk
        if len(self._buf) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buf)
        _check_length(length)
        if len(self._buf) < _LENGTH.size + length:
            return None
        return bytes(self._buf[_LENGTH.size:_LENGTH.size + length])


def _check_length(length: int) -> None:
    if length > MAX_MESSAGE:
        raise NumaEngramError(f"a group message of {length} bytes (at most {MAX_MESSAGE})")


def _refuse(conn: socket.socket, why: str, kind: bytes = b"refused") -> None:
    """Tell a joining member why it is not in a group (``kind`` b"timeout":
    the group did not form in time) and close."""
    try:
        _send_frame(conn, kind + b":" + why.encode(), time.monotonic() + 1.0)
    except (OSError, GroupTimeout):
        pass  # it left: nothing to tell
    conn.close()


def _bind(server: socket.socket, path: str) -> tuple[int, int]:
    """Bind ``path``, replacing a socket no one listens at (a leader that
    died); a live one, or anything else there, is an error naming it."""
    state = free_socket_path(path)
    if state == "not a socket":
        raise NumaEngramError(f"{path} exists and is not a socket: pass a free path for the "
                              f"group")
    if state == "in use":
        raise NumaEngramError(f"{path} is in use by a live group: give each group its own path")
    try:
        server.bind(path)
    except OSError as exc:
        raise NumaEngramError(f"cannot listen at {path}: {exc}") from exc
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _unlink_if(path: str, bound: tuple[int, int]) -> None:
    """Remove ``path`` if it is still the socket this leader bound."""
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) == bound:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise GroupTimeout("no time left to send")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise GroupTimeout("the peer did not take the message in time") from None


def _send_frame(sock: socket.socket, body: bytes, deadline: float) -> None:
    _send_all(sock, _LENGTH.pack(len(body)) + body, deadline)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GroupTimeout("no answer in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise GroupTimeout("no answer in time") from None
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    _check_length(length)
    return _recv_exact(sock, length, deadline)
