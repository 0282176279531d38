"""Backing-file lifecycle on tmpfs: header, create, place, populate, attach,
unlink, close, and gc of files whose creator died.

``BackingFile.create`` is DESIGN.md section 3 steps 1-7 in one visible
sequence; ``attach`` is what a peer does in step 8.  No torch here.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from . import native
from .accounting import check_memory
from .errors import CapacityError, SpecMismatchError, StorageError
from .topology import Topology

log = logging.getLogger(__name__)

PREFIX = "numa-engram-"
MAGIC = b"NUMAENGR"
FORMAT_VERSION = 2
DEFAULT_DIRECTORY = "/dev/shm"
SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
STATE_CREATING, STATE_READY, STATE_FAILED = 0, 1, 2
STATE_NAMES = {STATE_CREATING: "CREATING", STATE_READY: "READY", STATE_FAILED: "FAILED"}
MAX_REGIONS = 16

# magic, version, state, creator pid, creator uid, creator start time (ticks),
# boot id, fingerprint (32 raw bytes), file size, region count, then the
# shard key: layer id, head start, head end, row start, row end
_HEAD = struct.Struct("<8sIIIIQ16s32sQIiIIQQ")
_REGION = struct.Struct("<32sQQ")
_STATE_OFFSET = 12
# Each loading member's progress (a counter it bumps as it goes) lives in its
# own 8-byte slot, so the others can tell a slow load from a dead loader.
PROGRESS_OFFSET = 2048
MAX_LOADERS = 64
_SLOT = struct.Struct("<Q")


class RangePolicy(Protocol):
    """What create() needs of a placement plan (placement.PlacementPlan is
    one): refuse bad ranges before anything exists, then bind them."""

    def validate(self, file_size: int, topology: Topology | None = None) -> None: ...
    def apply(self, mapping: native.Mapping, topology: Topology | None = None) -> None: ...


@dataclass(frozen=True)
class ShardKey:
    """Which rows a table file holds: a layer, a head range and its rows.
    Checked at join and attach, so a member that asks for other rows with
    the same row count fails instead of reading the wrong ones."""

    layer_id: int = -1
    head_start: int = 0
    head_end: int = 0
    row_start: int = 0
    row_end: int = 0

    def __str__(self) -> str:
        return (f"layer {self.layer_id}, heads [{self.head_start}, {self.head_end}), "
                f"rows [{self.row_start}, {self.row_end})")


@dataclass(frozen=True)
class LayoutRegion:
    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class Layout:
    """Header page, then each region page-aligned, in order."""

    regions: tuple[LayoutRegion, ...]
    file_size: int

    @classmethod
    def of(cls, sizes: Sequence[tuple[str, int]]) -> Layout:
        if not sizes or len(sizes) > MAX_REGIONS:
            raise StorageError(f"a backing file holds 1 to {MAX_REGIONS} regions, got {len(sizes)}")
        page = native.PAGE_SIZE
        offset, regions = page, []
        for name, length in sizes:
            if length <= 0:
                raise StorageError(f"region {name!r} has size {length}; sizes must be > 0")
            if len(name.encode()) > 32:
                raise StorageError(f"region name {name!r} is longer than 32 bytes")
            regions.append(LayoutRegion(name, offset, int(length)))
            offset += (int(length) + page - 1) // page * page
        return cls(tuple(regions), offset)

    def region(self, name: str) -> LayoutRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise StorageError(f"the backing file has no region {name!r}; its regions are "
                           f"{[r.name for r in self.regions]}: not a table of this kind")


@dataclass(frozen=True)
class Header:
    version: int
    state: int
    creator_pid: int
    creator_uid: int
    creator_start: int
    boot_id: bytes
    fingerprint: bytes
    layout: Layout
    key: ShardKey = ShardKey()

    def pack(self) -> bytes:
        k = self.key
        head = _HEAD.pack(MAGIC, self.version, self.state, self.creator_pid, self.creator_uid,
                          self.creator_start, self.boot_id, self.fingerprint,
                          self.layout.file_size, len(self.layout.regions), k.layer_id,
                          k.head_start, k.head_end, k.row_start, k.row_end)
        regions = b"".join(_REGION.pack(r.name.encode(), r.offset, r.length)
                           for r in self.layout.regions)
        return head + regions

    @classmethod
    def unpack(cls, data: bytes, where: str) -> Header:
        if len(data) < _HEAD.size:
            raise StorageError(f"{where} is too short ({len(data)} bytes) to be a numa_engram "
                               "backing file")
        if data[:8] != MAGIC:
            raise StorageError(f"{where} is not a numa_engram backing file (magic {data[:8]!r})")
        version = struct.unpack_from("<I", data, 8)[0]
        if version != FORMAT_VERSION:
            raise StorageError(f"{where} has format version {version}, this library reads "
                               f"{FORMAT_VERSION}; recreate the table with this version")
        (magic, version, state, pid, uid, start, boot, fp, size, count,
         *key) = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise StorageError(f"{where} is not a numa_engram backing file (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise StorageError(f"{where} has format version {version}, this library reads "
                               f"{FORMAT_VERSION}; recreate the table with this version")
        if not 0 < count <= MAX_REGIONS:
            raise StorageError(f"{where} header claims {count} regions (1 to {MAX_REGIONS})")
        if len(data) < _HEAD.size + count * _REGION.size:
            raise StorageError(f"{where} is too short ({len(data)} bytes) for its header")
        regions = []
        for i in range(count):
            name, offset, length = _REGION.unpack_from(data, _HEAD.size + i * _REGION.size)
            try:
                text = name.rstrip(b"\0").decode()
            except UnicodeDecodeError:
                raise StorageError(f"{where} has a corrupt header (region {i} name)") from None
            if offset % native.PAGE_SIZE or offset + length > size:
                raise StorageError(f"{where} has a corrupt header: region {text!r} "
                                   f"[{offset}, {offset + length}) is not inside {size} bytes")
            regions.append(LayoutRegion(text, offset, length))
        return cls(version, state, pid, uid, start, boot, fp, Layout(tuple(regions), size),
                   ShardKey(*key))


# ---------------------------------------------------------------- checks --

def boot_id() -> bytes:
    return uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes


def directory_id(directory: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a table directory, None where it does not exist:
    processes can share a table file iff this (and host and uid) are equal."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def describe_device(dir_id: tuple[int, int] | None) -> str:
    """'dev 0:39 inode 5' for a ``directory_id`` (the inode of a mount's
    root, 1 or 2, is left out)."""
    if dir_id is None:
        return "none: it does not exist there"
    dev, ino = dir_id
    return f"dev {os.major(dev)}:{os.minor(dev)}" + (f" inode {ino}" if ino > 2 else "")


def process_start_time(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (None if no such process)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat_line.rsplit(")", 1)[1].split()[19])


def check_shmem_thp(path: Path = SHMEM_THP) -> None:
    """Refuse to run when shared-memory THP is forced on every mount."""
    try:
        text = path.read_text()
    except OSError:
        return
    if "[force]" in text:
        raise StorageError(
            f"{path} is 'force': shared memory would use huge pages, which pinning splits and "
            f"placement cannot verify; run 'echo never > {path}' (or 'advise') as root")


def check_directory(directory: str) -> None:
    """A table directory must be a real directory on tmpfs or hugetlbfs:
    anywhere else the table would be written back to a disk."""
    if os.path.islink(directory):
        raise StorageError(f"directory {directory!r} is a symlink; pass the directory it "
                           f"points to ({os.path.realpath(directory)!r}) if you trust it")
    if not os.path.exists(directory):
        raise StorageError(f"directory {directory!r} does not exist; mount a tmpfs there or "
                           "pass directory= another tmpfs")
    if not os.path.isdir(directory):
        raise StorageError(f"directory {directory!r} is not a directory (a regular file?); "
                           "pass the tmpfs directory the table should live in, e.g. /dev/shm")
    fs_type = native.statfs_type(directory)
    if fs_type not in (native.TMPFS_MAGIC, native.HUGETLBFS_MAGIC):
        raise StorageError(f"directory {directory!r} is not on tmpfs or hugetlbfs (file system "
                           f"magic {fs_type:#x}): a table there would be written to disk; "
                           "use /dev/shm or mount a tmpfs (mount -t tmpfs -o size=... tmpfs DIR)")


def check_space(directory: str, size: int) -> None:
    check_directory(directory)
    free, total = native.statvfs(directory)
    if size > free:
        raise CapacityError(
            f"{directory} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB but the "
            f"table needs {size / 2**30:.2f} GiB; enlarge it (mount -o remount,size=...) or "
            "use another directory")


# ------------------------------------------------------------------ file --

class BackingFile:
    """One mapped backing file.  Use ``create`` (leader) or ``attach`` (peer)."""

    def __init__(self, path: str, fd: int, header: Header, mapping: native.Mapping,
                 owner: bool) -> None:
        self.path = path
        self.fd = fd
        self.header = header
        self.layout = header.layout
        self.mapping = mapping
        self.owner = owner
        self.unlinked = False

    # ---------------------------------------------------------- create --
    @classmethod
    def create(cls, layout: Layout, fingerprint: bytes, *,
               directory: str | None = DEFAULT_DIRECTORY, placement: RangePolicy | None = None,
               topology: Topology | None = None, populate: bool = True,
               key: ShardKey = ShardKey()) -> BackingFile:
        """Steps 1-7: check, create exclusively, header, size, map, no THP,
        bind, populate.  Any failure removes the file before raising.

        ``directory=None`` makes a private table on an anonymous memfd: the
        same shmem pages and policies, but no path at all (nothing to leak,
        not limited by the size of /dev/shm, but by memory like any table:
        both are checked against MemAvailable, the planned nodes' free memory
        and the cgroup limits before anything is allocated)."""
        check_shmem_thp()                                            # 1
        if directory is not None:
            check_space(directory, layout.file_size)
        if placement is not None:
            placement.validate(layout.file_size, topology or Topology.detect())
        check_memory(layout.file_size,
                     placement.bytes_per_node() if hasattr(placement, "bytes_per_node") else None)
        path, fd = _create_exclusive(directory)                      # 2
        try:
            header = _new_header(layout, fingerprint, key)
            os.pwrite(fd, header.pack(), 0)
            os.ftruncate(fd, layout.file_size)                       # 3
            mapping = native.Mapping(fd, layout.file_size)
            native.madvise(mapping, native.MADV_NOHUGEPAGE)          # 4
            if placement is not None:
                placement.apply(mapping, topology)                   # 5
            if populate:
                native.fallocate(fd, 0, layout.file_size, path)      # 6
        except BaseException:
            _remove(path, fd)
            raise
        log.debug("created %s (%d bytes)", path, layout.file_size)
        return cls(path, fd, header, mapping, owner=True)

    # ---------------------------------------------------------- attach --
    @classmethod
    def attach(cls, path: str | None = None, *, fd: int | None = None,
               fingerprint: bytes | None = None, file_size: int | None = None,
               writable: bool = False, key: ShardKey | None = None) -> BackingFile:
        """Map an existing file (by path or an open fd) after checking that
        it is ours: no symlink, our uid, our magic and version, the expected
        fingerprint, size and shard key.  Holds a shared lock on the file
        while attached (gc's liveness test)."""
        if (path is None) == (fd is None):
            raise ValueError("give exactly one of path= or fd=")
        where = path if path is not None else f"fd {fd}"
        if path is not None:
            fd = _open_existing(path, writable)
        else:
            fd = os.dup(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            header = _check_file(fd, where, fingerprint, file_size, key)
            mapping = native.Mapping(fd, header.layout.file_size, writable)
        except BaseException:
            os.close(fd)
            raise
        return cls(where, fd, header, mapping, owner=False)

    # ------------------------------------------------------------ state --
    def read_header(self) -> Header:
        return Header.unpack(os.pread(self.fd, native.PAGE_SIZE, 0), self.path)

    def set_state(self, state: int) -> None:
        os.pwrite(self.fd, struct.pack("<I", state), _STATE_OFFSET)

    def mark_ready(self) -> None:
        self.set_state(STATE_READY)

    def seal(self) -> None:
        """Read-only from now on (a loaded table is never written again)."""
        self.mapping.seal()

    def write_progress(self, slot: int, value: int) -> None:
        """This loader's progress counter (the others watch it advance)."""
        if not 0 <= slot < MAX_LOADERS:
            raise StorageError(f"loader slot {slot} is outside 0..{MAX_LOADERS - 1}")
        os.pwrite(self.fd, _SLOT.pack(value), PROGRESS_OFFSET + slot * _SLOT.size)

    def read_progress(self) -> tuple[int, ...]:
        data = os.pread(self.fd, MAX_LOADERS * _SLOT.size, PROGRESS_OFFSET)
        return tuple(v for (v,) in _SLOT.iter_unpack(data))

    @property
    def state(self) -> int:
        return self.read_header().state

    def region(self, name: str) -> np.ndarray:
        """uint8 view of one region (exactly its length, not the page padding)."""
        r = self.layout.region(name)
        return self.mapping.array(r.offset, r.length)

    # ------------------------------------------------------------- end --
    def unlink(self) -> None:
        """Remove the path; the mappings keep the memory alive."""
        if self.owner and not self.unlinked and not self.path.startswith("memfd:"):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.unlinked = True

    def close(self) -> None:
        """Unmap and close (idempotent).  The creator also unlinks."""
        if self.owner:
            self.unlink()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> BackingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_exclusive(directory: str | None) -> tuple[str, int]:
    if directory is None:
        name = PREFIX + secrets.token_hex(8)
        return f"memfd:{name}", os.memfd_create(name, os.MFD_CLOEXEC)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    path = os.path.join(directory, PREFIX + secrets.token_hex(8))
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise StorageError(f"cannot create {path}: {exc.strerror}") from exc
    # held for the creator's life (and by every attached member): gc tells a
    # live table from a dead one by this lock, whatever pid namespace holds it
    fcntl.flock(fd, fcntl.LOCK_SH)
    return path, fd


def _new_header(layout: Layout, fingerprint: bytes, key: ShardKey) -> Header:
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    pid = os.getpid()
    return Header(FORMAT_VERSION, STATE_CREATING, pid, os.geteuid(),
                  process_start_time(pid) or 0, boot_id(), fingerprint, layout, key)


def _remove(path: str, fd: int) -> None:
    if not path.startswith("memfd:"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.close(fd)


def _open_existing(path: str, writable: bool) -> int:
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise StorageError(f"{path} is a symlink; refusing to follow it") from exc
        if exc.errno == 13:
            raise StorageError(f"{path}: permission denied; a table is readable only by the "
                               "user that created it (mode 0600): run as that user") from exc
        raise StorageError(f"cannot open {path}: {exc.strerror}") from exc


def _check_file(fd: int, where: str, fingerprint: bytes | None,
                file_size: int | None, key: ShardKey | None = None) -> Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{where} is not a regular file")
    if st.st_uid != os.geteuid():
        raise StorageError(f"{where} is owned by uid {st.st_uid}, not by this process's uid "
                           f"{os.geteuid()}; only the creator's user may attach")
    header = Header.unpack(os.pread(fd, native.PAGE_SIZE, 0), where)
    if header.creator_uid != st.st_uid:
        raise StorageError(f"{where} header names creator uid {header.creator_uid} but the "
                           f"file belongs to uid {st.st_uid}")
    if st.st_size != header.layout.file_size:
        raise StorageError(f"{where} is {st.st_size} bytes but its header says "
                           f"{header.layout.file_size}: truncated or not finished")
    if key is not None and header.key != key:
        raise SpecMismatchError(f"{where} holds {header.key}, but {key} was asked for; pass "
                                "the layer and shard the table was created with")
    if file_size is not None and header.layout.file_size != file_size:
        raise StorageError(f"{where} is {header.layout.file_size} bytes, expected {file_size}")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise SpecMismatchError(f"{where} was built for spec {header.fingerprint.hex()[:16]}, "
                                f"this process has spec {fingerprint.hex()[:16]}; both sides "
                                "must use the same EngramSpec")
    return header


def table_fds(pid: int) -> list[tuple[int, str]]:
    """(fd, target) of every table file a live process holds open, unlinked
    or memfd ones included: a running server's tables can be inspected."""
    out = []
    base = f"/proc/{pid}/fd"
    for entry in sorted(os.listdir(base), key=int):
        try:
            target = os.readlink(f"{base}/{entry}")
        except OSError:
            continue
        if PREFIX in target:
            out.append((int(entry), target))
    return out


def open_process_fd(pid: int, fd: int) -> int:
    """Our own descriptor for another process's open file (same user or root)."""
    try:
        return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"cannot open fd {fd} of pid {pid}: {exc.strerror}; run as the "
                           "same user or root") from exc


# -------------------------------------------------------------------- gc --

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
        return GcEntry(path, 0, 0, f"skipped: not a regular file ({_file_kind(st.st_mode)})",
                       False)
    if st.st_uid != os.geteuid() and not all_users:
        return GcEntry(path, st.st_size, 0, f"kept: owned by uid {st.st_uid} (root may pass "
                       "--all-users to include other users' files)", False)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return GcEntry(path, st.st_size, 0, f"kept: cannot open ({exc.strerror})", False)
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or not stat.S_ISREG(now.st_mode):
            return GcEntry(path, st.st_size, 0, "skipped: replaced while being checked", False)
        try:
            header = Header.unpack(os.pread(fd, native.PAGE_SIZE, 0), path)
        except (StorageError, struct.error) as exc:
            return GcEntry(path, st.st_size, 0, f"skipped: {exc}", False)
        pid = header.creator_pid
        if header.boot_id == boot_id():
            alive = holders_alive(fd)
            if alive is None:
                return GcEntry(path, st.st_size, pid, "kept: liveness cannot be decided (the "
                               "file system refuses locks)", False)
            if alive:
                return GcEntry(path, st.st_size, pid, "kept: in use (a process holds its "
                               "lock)", False)
            reason = f"stale: no process holds it (creator pid {pid} is dead)"
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


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISLNK, "a symlink"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")
