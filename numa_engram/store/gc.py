"""gc of table files whose creator died: a file no process holds (each
holder keeps a shared flock on it for its life, whatever pid namespace it
runs in) or from another boot.  Anything that is not our regular file is
reported and left alone.  And of the hand-over directories (fdhandover)
whose holders were all killed: no holder answers at any socket there.
No torch here.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass

from ..errors import StorageError
from ..host import procfs
from ..literals import DEFAULT_DIRECTORY
from ..userfiles import file_kind
from . import fdhandover
from .fileformat import PREFIX, OldFormatError
from .storage import read_header

# how a file that may not be ours is opened for a look: never blocking on a
# FIFO, never following a symlink, never handed to a child
OPEN_TO_INSPECT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class GcEntry:
    path: str
    size: int
    creator_pid: int
    reason: str  # why it is stale, or why it was kept or skipped
    removed: bool


def holders_alive(fd: int) -> bool | None:
    """Does any process hold the file open as a table (its creator or an
    attached member: each keeps a shared lock for its life)?  None when the
    lock cannot be tested.  Works across pid namespaces, unlike a pid."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def gc_stale_files(directory: str = DEFAULT_DIRECTORY, dry_run: bool = False,
                   all_users: bool = False) -> list[GcEntry]:
    """Remove backing files (by prefix and header) that no process holds
    (the creator's lock is gone) or from another boot.  Files in use, files
    of other users (unless ``all_users``, for root), files whose liveness
    cannot be decided and entries that are not our regular files are
    reported with the reason and left alone."""
    if not os.path.isdir(directory):
        raise StorageError(f"directory {directory!r} does not exist or is not a directory")
    entries = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(PREFIX):
            entries.append(_gc_one(os.path.join(directory, name), dry_run, all_users))
    return entries


def _gc_one(path: str, dry_run: bool, all_users: bool) -> GcEntry:
    try:
        st = os.lstat(path)  # never open a FIFO, device or directory
    except OSError as exc:
        return GcEntry(path, 0, 0, f"skipped: {exc.strerror}", False)
    if not stat.S_ISREG(st.st_mode):
        return GcEntry(path, 0, 0, f"skipped: not a regular file ({file_kind(st.st_mode)})",
                       False)
    if st.st_uid != os.geteuid() and not all_users:
        return GcEntry(path, st.st_size, 0, f"kept: owned by uid {st.st_uid} (root may pass "
                       "--all-users to include other users' files)", False)
    try:
        fd = os.open(path, OPEN_TO_INSPECT)
    except OSError as exc:
        return GcEntry(path, st.st_size, 0, f"kept: cannot open ({exc.strerror})", False)
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or not stat.S_ISREG(now.st_mode):
            return GcEntry(path, st.st_size, 0, "skipped: replaced while being checked", False)
        try:
            header = read_header(fd, path, now.st_size)
            pid, this_boot = header.creator_pid, header.boot_id == procfs.boot_id()
        except OldFormatError:  # still ours (our prefix, our magic): its lock decides
            pid, this_boot = 0, True
        except (StorageError, struct.error) as exc:
            return GcEntry(path, st.st_size, 0, f"skipped: {exc}", False)
        if this_boot:
            alive = holders_alive(fd)
            if alive is None:
                return GcEntry(path, st.st_size, pid, "kept: liveness cannot be decided (the "
                               "file system refuses locks)", False)
            if alive:
                return GcEntry(path, st.st_size, pid, "kept: in use (a process holds its "
                               "lock)", False)
            reason = f"stale: no process holds it (creator pid {pid} is dead)" if pid else \
                "stale: an older format's file no process holds"
        else:
            reason = "stale: creator from another boot"
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return GcEntry(path, st.st_size, pid, reason, not dry_run)


def gc_handover_directories(under: str | None = None,
                            dry_run: bool = False) -> list[GcEntry]:
    """Remove the hand-over directories of ours under ``under`` (default:
    where they are made, ``fdhandover.root()``) that no holder answers in:
    every holder of that table was killed (its memory is gone with them),
    or none came for ``STALE_S``.  Those a holder answers in, or being made
    (young, no holder's socket yet), and other users', are reported and
    kept; entries that are not directories are table files'
    (``gc_stale_files``), not listed here."""
    under = fdhandover.root() if under is None else under
    if not os.path.isdir(under):
        raise StorageError(f"directory {under!r} does not exist or is not a directory")
    entries = []
    for name in sorted(os.listdir(under)):
        if name.startswith(PREFIX):
            entry = _gc_handover(os.path.join(under, name), dry_run)
            if entry is not None:
                entries.append(entry)
    return entries


def _gc_handover(path: str, dry_run: bool) -> GcEntry | None:
    try:
        st = os.lstat(path)  # a symlink is not followed into another directory
        if not stat.S_ISDIR(st.st_mode):
            return None
        if st.st_uid != os.geteuid():
            return GcEntry(path, 0, 0, f"kept: a hand-over directory of uid {st.st_uid} (its "
                           "owner's gc removes it)", False)
        live, dead = fdhandover.census(path)
    except (OSError, StorageError) as exc:
        return GcEntry(path, 0, 0, f"skipped: {getattr(exc, 'strerror', None) or exc}", False)
    if live:
        if dead and not dry_run:
            fdhandover.sweep(path)  # the killed holders' sockets alone
        gone = f"; {dead} killed holder(s)' socket(s) {'would go' if dry_run else 'removed'}" \
            if dead else ""
        return GcEntry(path, 0, 0, f"kept: in use ({live} holder(s) answer there{gone})", False)
    if not dead and not fdhandover.untouched(path):
        return GcEntry(path, 0, 0, "kept: being made (no holder's socket yet, younger than "
                       f"{fdhandover.STALE_S:g} s)", False)
    reason = f"stale: no holder answers there ({dead} dead socket(s)): the table is gone"
    if dry_run:
        return GcEntry(path, 0, 0, reason, False)
    fdhandover.sweep(path)
    if os.path.lexists(path):  # a holder joined meanwhile
        return GcEntry(path, 0, 0, "kept: a holder came while it was swept", False)
    return GcEntry(path, 0, 0, reason, True)
