"""A shared table's descriptor handed between the processes that hold it,
over Unix sockets in a directory only this user can enter (mode 0700).

A dp_shared table on 4 KiB pages is a memfd: it has no path, so nothing in
/dev/shm to size or to leave behind.  Every holder listens at a socket of
its own in the table's hand-over directory for as long as it holds the
table; a process that wants the table (a member at create, a late one
after) connects to any live holder, which checks the peer's credentials
(our uid or root, as the table service does) and answers the table
service's attach request (``serviceclient``: one wire protocol) with the
descriptor.  The memory goes with the last holder's mapping; the last
holder to leave removes the directory, the socket of a holder that was
killed is removed by whoever finds it dead, and a directory whose holders
were all killed by the next table made under the same root.  No torch
here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable

from ..errors import ServiceRefusal, SpecError, StorageError
from . import serviceclient
from .fileformat import PREFIX
from .unixsockets import answers, free_socket_path, peer_uid

log = logging.getLogger(__name__)

SUFFIX = ".sock"
ROOT_ENV = "XDG_RUNTIME_DIR"
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the NUL
MAX_ANSWERING = 32  # connections answered at once; one more sheds the oldest (a silent peer)
STALE_S = 60.0  # a directory (or staging socket) untouched this long is no table's in the making
# a holder of our uid or root: the members' loaders write the table, so it
# is not sealed (a holder of our uid could write it anyway)
TRUST = serviceclient.ServiceTrust(allow_unsealed=True)
Answer = Callable[[serviceclient.TableRequest], tuple[dict, "int | None"]]


def root() -> str:
    """Where hand-over directories are made: ``$XDG_RUNTIME_DIR`` (a
    per-user tmpfs) where it names a directory of ours, else the temporary
    directory (``$TMPDIR``, /tmp)."""
    runtime = os.environ.get(ROOT_ENV, "")
    if runtime and _ours(runtime):
        return runtime
    return tempfile.gettempdir()


def _ours(directory: str) -> bool:
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def check_root(under: str) -> None:
    """Hand-over directories can be made under ``under`` (a member's join
    checks it, so a group that cannot meet there falls back or fails as
    one, before anything is allocated)."""
    if not os.access(under, os.W_OK | os.X_OK):
        raise StorageError(f"cannot make the table's hand-over directory under {under}: not "
                           f"writable by uid {os.geteuid()}; set {ROOT_ENV} or TMPDIR to a "
                           "directory this user may write")
    _socket_path(os.path.join(under, PREFIX + "x" * 8), "x" * 16 + SUFFIX)


def new_directory(under: str) -> str:
    """A fresh hand-over directory under ``under``, mode 0700 (the ones
    every holder of which was killed are removed first)."""
    check_root(under)
    sweep_root(under)
    try:
        made = tempfile.mkdtemp(prefix=PREFIX, dir=under)
        os.chmod(made, 0o700)  # (mkdtemp's mode is masked: under umask 0777, 0000)
        return made
    except OSError as exc:
        raise StorageError(f"cannot make a hand-over directory for the table's sockets under "
                           f"{under}: {exc.strerror}; set {ROOT_ENV} or TMPDIR to a directory "
                           "this user may write") from exc


def handover_path(value: object) -> str:
    """``value`` (a table's ``handover``, as given to ``attach(peers=)``) as
    a path, or a SpecError naming it."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise SpecError(f"peers must be a hand-over directory's path (table.handover), got "
                        f"{value!r}")
    return path


def check_directory(directory: str) -> None:
    """A hand-over directory must be a real directory of ours that no one
    else may enter: a socket there is reachable by this user (and root) only."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise StorageError(f"the table's hand-over directory {directory} does not exist: no "
                           "process holds the table any more") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{directory} is not a directory (a symlink?); pass the table's "
                           "hand-over directory (SharedEngramTable.handover)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise StorageError(f"{directory} belongs to uid {st.st_uid} with mode "
                           f"{stat.S_IMODE(st.st_mode):04o}; a hand-over directory must be "
                           f"ours (uid {os.geteuid()}) and mode 0700, or another user could "
                           "reach or replace its sockets")


def _socket_path(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StorageError(f"the hand-over socket path {path} is {len(os.fsencode(path))} "
                           f"bytes, above the {MAX_SOCKET_PATH} a Unix socket allows; set "
                           f"{ROOT_ENV} or TMPDIR to a shorter directory")
    return path


def refusal(reason: str, message: str) -> dict:
    """An answer that hands nothing over (the table service's form)."""
    return {"ok": False, "reason": reason, "message": message, "detail": {}}


# ------------------------------------------------------------ holder --

class Holder:
    """This process's socket in a table's hand-over directory: each
    connection of our uid (or root) gets ``answer(request)``'s answer and
    descriptor (closed here once sent); anyone else a refusal.  One thread
    waits in ``accept`` (no polling) and one short thread answers each
    connection, so a client that says nothing holds up only itself; at
    most ``MAX_ANSWERING`` at once (a new one sheds the oldest), so peers
    that say nothing cost a bounded number of threads."""

    def __init__(self, directory: str, answer: Answer) -> None:
        try:
            os.mkdir(directory, 0o700)  # its last holder left meanwhile
            os.chmod(directory, 0o700)  # (the umask masks mkdir's mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StorageError(f"cannot make the hand-over directory {directory}: "
                               f"{exc.strerror}") from exc
        check_directory(directory)
        self.directory, self._answer, self._closed = directory, answer, False
        # held while an answer is made: close() waits for it, so no answer
        # reads the table's descriptor after its owner closed it
        self._answering = threading.Lock()
        self._open: dict[socket.socket, None] = {}  # connections being answered, oldest first
        self._open_lock = threading.Lock()
        name = secrets.token_hex(8)
        self.path = _socket_path(directory, name + SUFFIX)
        # bound and listening under another name, then renamed: a sweep never
        # finds this holder's socket before it answers
        staging = _socket_path(directory, f".{name}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(staging)
            os.chmod(staging, 0o600)  # (the directory keeps others out already)
            self._sock.listen(64)
            os.rename(staging, self.path)
        except OSError as exc:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise StorageError(f"cannot listen at {self.path} to hand the table over: "
                               f"{exc.strerror}") from exc
        threading.Thread(target=self._serve, name="numa-engram-handover", daemon=True).start()
        _LIVE.add(self)

    def _forget_in_child(self) -> None:
        """A forked child has the socket but no thread answering at it: it
        closes its copy, so a peer never waits on a child that outlives us
        (the socket's path stays: it is the parent's)."""
        self._closed = True
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return  # shutdown() woke accept
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    time.sleep(0.05)  # the queued peer waits; never spin
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self._open_lock:
            if len(self._open) >= MAX_ANSWERING:
                oldest = next(iter(self._open))
                del self._open[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread wakes and closes it
            self._open[conn] = None
        try:
            threading.Thread(target=self._answer_one, args=(conn,),
                             name="numa-engram-handover-conn", daemon=True).start()
        except RuntimeError:  # no thread to be had: this peer is refused, the next may fit
            self._forget(conn)
            conn.close()
            log.warning("table hand-over at %s: no thread to answer a peer", self.path)

    def _forget(self, conn: socket.socket) -> None:
        with self._open_lock:
            self._open.pop(conn, None)

    def _answer_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(serviceclient.CLIENT_TIMEOUT_S)
                _, uid, _ = peer_uid(conn)
                if uid not in (os.geteuid(), 0):
                    log.warning("table hand-over at %s: refused uid %d", self.path, uid)
                    serviceclient.send_answer(conn, refusal("refused",
                                                            f"uid {uid} may not have this table"))
                    return
                try:
                    request = serviceclient.TableRequest.from_dict(
                        serviceclient.read_request(conn, serviceclient.CLIENT_TIMEOUT_S))
                except (ValueError, TypeError) as exc:
                    serviceclient.send_answer(conn, refusal("bad_request", str(exc)[:200]))
                    return
                with self._answering:
                    doc, fd = self._answer(request) if not self._closed else \
                        (refusal("no_such_table", "the table was closed"), None)
                try:
                    serviceclient.send_answer(conn, doc, fd)
                finally:
                    if fd is not None:
                        os.close(fd)
            except OSError:
                pass  # the peer went away, or the table was closed meanwhile
            except Exception as exc:  # one answer's failure ends its connection alone
                log.warning("table hand-over at %s: a peer's answer failed: %s", self.path, exc)
            finally:
                self._forget(conn)

    def close(self) -> None:
        """Stop answering, remove this socket, then the directory when no
        live holder is left in it (idempotent)."""
        if self._closed:
            return
        with self._answering:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sweep(self.directory)


_LIVE: weakref.WeakSet[Holder] = weakref.WeakSet()


def _forget_in_child() -> None:
    for holder in list(_LIVE):
        holder._forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)


def sweep(directory: str) -> None:
    """Remove the sockets no one answers at (holders that were killed), a
    socket a holder was killed before it listened at, and the directory
    once it is empty."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # another sweeper may remove it first
            if name.endswith(SUFFIX):
                free_socket_path(path)
            elif name.startswith(".") and _older_than(path, STALE_S):
                os.unlink(path)
    with contextlib.suppress(OSError):  # not empty: a holder is still there
        os.rmdir(directory)


def census(directory: str) -> tuple[int, int]:
    """(holders answering, holders' sockets no one answers at) in a
    hand-over directory: probed, nothing removed (gc's dry run)."""
    live = dead = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):  # a holder leaving meanwhile
            st = os.lstat(path)
            if name.endswith(SUFFIX) and stat.S_ISSOCK(st.st_mode):
                if answers(path, st.st_uid):
                    live += 1
                else:
                    dead += 1
    return live, dead


def untouched(directory: str) -> bool:
    """No holder came or went for ``STALE_S``: no table is being made there."""
    return _older_than(directory, STALE_S)


def sweep_root(under: str) -> None:
    """Sweep the hand-over directories of ours under ``under`` that no
    holder has touched for ``STALE_S``: where every holder was killed, no
    one was left to remove them (a directory being made is younger)."""
    try:
        names = [n for n in os.listdir(under) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(under, name)
        if _ours(path) and untouched(path):
            sweep(path)


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > seconds
    except OSError:
        return False


# ------------------------------------------------------------ client --

def holders(directory: str) -> list[str]:
    """The holders' sockets in a hand-over directory (live or not)."""
    check_directory(directory)
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if n.endswith(SUFFIX))


def receive(directory: str, request: serviceclient.TableRequest, timeout_s: float,
            only: str | None = None) -> tuple[int, int]:
    """(a descriptor of the table ``request`` names, its holder's uid) from
    the first live holder in ``directory`` (``only``: that holder's socket),
    within ``timeout_s`` as a whole: each holder asked gets an even share of
    the time left, so holders that accept but never answer (stopped, hung)
    cannot keep a live one from being reached in time.  A holder that
    refuses (another table, another uid) is raised as its ServiceRefusal; a
    directory where no one answers is swept and refused."""
    candidates = [only] if only is not None else holders(directory)
    deadline = time.monotonic() + timeout_s
    why = []
    for asked, path in enumerate(candidates):
        share = (deadline - time.monotonic()) / (len(candidates) - asked)
        if share <= 0:
            why.append(f"no time left for {path} within {timeout_s:g} s")
            continue
        try:
            fd, _, uid = serviceclient.fetch(path, request, share, TRUST)
        except ServiceRefusal:
            raise
        except StorageError as exc:  # a holder killed (its socket left) or gone meanwhile
            why.append(str(exc))
            continue
        return fd, uid
    sweep(directory)
    raise StorageError(f"no process holding the table answered at {directory}: the holders "
                       f"are gone or stopped ({'; '.join(why) or 'no socket there'})")
