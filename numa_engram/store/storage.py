"""Backing-file lifecycle on tmpfs or hugetlbfs: check, create, place,
populate, attach, unlink, close (the format is fileformat's, gc is gc's).

``BackingFile.create`` is the protocol's create step (docs/design.md,
"Order of operations", step 3) in one visible sequence; ``attach`` is what
a peer does in the map step.  No torch here.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import secrets
import stat
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..bindings import native
from ..errors import SpecMismatchError, StorageError, SyscallError
from ..host import hugepages, procfs
from ..host.accounting import check_memory
from ..host.topology import Topology
from ..literals import DEFAULT_DIRECTORY
from . import fdhandover, serviceclient
from .chunks import for_each_chunk
from .directories import check_directory_room, check_shmem_thp
from .fileformat import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_LOADERS,
    PREFIX,
    PROGRESS_OFFSET,
    SLOT,
    STATE_CREATING,
    STATE_OFFSET,
    STATE_READY,
    Header,
    Layout,
    ShardKey,
    older_format,
)

log = logging.getLogger(__name__)

NO_KEY = ShardKey()
POPULATE_CHUNK = 64 << 20  # progress granularity of populate


class RangePolicy(Protocol):
    """What create() needs of a placement plan (placement.PlacementPlan is
    one): refuse bad ranges before anything exists, then bind them."""

    def validate(self, file_size: int, topology: Topology | None = None,
                 page_size: int = native.PAGE_SIZE) -> None: ...
    def apply(self, mapping: native.Mapping, topology: Topology | None = None) -> None: ...
    def bytes_per_node(self) -> dict[int, int]: ...
    def to_dict(self) -> dict: ...


# ------------------------------------------------------------------ file --

class BackingFile:
    """One mapped backing file.  Use ``create`` (leader) or ``attach`` (peer)."""

    def __init__(self, path: str, fd: int, header: Header, mapping: native.Mapping,
                 owner: bool) -> None:
        self.path = path
        self.fd = fd
        # a backing dropped without close() still gives its descriptor back
        # (its mapping goes with its last view): no table file stays held
        self._fd_closer = weakref.finalize(self, os.close, fd)
        self.header = header
        self.layout = header.layout
        self.mapping = mapping
        self.owner = owner
        self.unlinked = False
        self._holder: fdhandover.Holder | None = None

    # ---------------------------------------------------------- create --
    @classmethod
    def create(cls, layout: Layout, fingerprint: bytes, *,
               directory: str | None = DEFAULT_DIRECTORY, placement: RangePolicy | None = None,
               topology: Topology | None = None, populate: bool = True,
               key: ShardKey = NO_KEY, progress: Callable[[int, int], None] | None = None,
               threads: int = 1, phases: dict[str, float] | None = None) -> BackingFile:
        """Steps 1-7: check, create exclusively, size, map, header, no THP,
        bind, populate.  Any failure removes the file before raising.

        ``directory=None`` makes a private table on an anonymous memfd: the
        same pages and policies, but no path at all (nothing to leak, not
        limited by the size of /dev/shm, but by memory like any table: both
        are checked against MemAvailable, the planned nodes' free memory and
        the cgroup limits before anything is allocated).  A layout with huge
        pages lives on hugetlbfs (``directory`` must be such a mount) or an
        MFD_HUGETLB memfd, and is checked against the huge page pool of
        each planned node instead.  ``progress(done, total)`` follows the
        populate; ``threads`` populate huge pages in parallel.  ``phases``
        gets the seconds of "create" (steps 1-5) and "populate" (step 6)."""
        page = layout.page_size
        started = time.perf_counter()
        _check_room(layout, directory, placement, topology)          # 1
        path, fd = _create_exclusive(directory, page)                # 2
        try:
            os.ftruncate(fd, layout.file_size)                       # 3
            mapping = _map_new(fd, layout, directory)
            header = _new_header(layout, fingerprint, key, placement)
            if not hugepages.is_huge(page):
                native.madvise(mapping, native.MADV_NOHUGEPAGE)      # 4
            if placement is not None:
                placement.apply(mapping, topology)                   # 5
            # after the policies: the header may share the last region's
            # page, which its write faults in.  Through the mapping:
            # hugetlbfs refuses write(2) (EINVAL)
            mapping.array(layout.header_offset, HEADER_BYTES)[:] = np.frombuffer(
                header.pack(), np.uint8)
            created = time.perf_counter()
            if populate:                                             # 6
                try:
                    _populate(fd, mapping, path, progress, threads)
                except SyscallError as exc:
                    if exc.errno != errno.ENOMEM or not hugepages.is_huge(page):
                        raise
                    raise hugepages.out_of_pages(layout.file_size, page, directory,
                                                 "populate") from exc
        except BaseException:
            _remove(path, fd)
            raise
        if phases is not None:
            phases["create"] = created - started
            phases["populate"] = time.perf_counter() - created
        log.debug("created %s (%d bytes, %s pages)", path, layout.file_size,
                  hugepages.name_of(page))
        return cls(path, fd, header, mapping, owner=True)

    # ---------------------------------------------------------- attach --
    @classmethod
    def attach(cls, path: str | None = None, *, fd: int | None = None,
               fingerprint: bytes | None = None, file_size: int | None = None,
               writable: bool = False, key: ShardKey | None = None,
               layout_for: Callable[[int], Layout] | None = None,
               owner_uid: int | None = None) -> BackingFile:
        """Map an existing file (by path or an open fd) after checking that
        it is ours: no symlink, our uid, our magic and version, the expected
        fingerprint, size and shard key, and (``layout_for(page size)``: the
        layout this spec and shard imply) every field of its layout.  Holds
        a shared lock on the file while attached (gc's liveness test).
        ``owner_uid``: the uid the file must belong to (default ours; a
        table service of another uid that this process trusts)."""
        if (path is None) == (fd is None):
            raise ValueError("give exactly one of path= or fd=")
        where = path if path is not None else _name_of(int(fd or 0))
        fd = _open_existing(path, writable) if path is not None else os.dup(int(fd or 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            header = _check_file(fd, where, fingerprint, file_size, key, owner_uid)
            if layout_for is not None:
                check_layout(header.layout, layout_for(header.layout.page_size), where)
            mapping = native.Mapping(fd, header.layout.file_size, writable,
                                     page_size=header.layout.page_size)
        except BaseException:
            os.close(fd)
            raise
        return cls(where, fd, header, mapping, owner=False)

    # ------------------------------------------------------------ state --
    def read_header(self) -> Header:
        return read_header(self.fd, self.path, self.layout.file_size)

    def _write(self, offset: int, data: bytes) -> None:
        """Header bytes through a writable mapping (hugetlbfs refuses
        write(2)), else with pwrite (a sealed or read-only tmpfs mapping)."""
        if self.mapping is not None and self.mapping.writable:
            self.mapping.array(offset, len(data))[:] = np.frombuffer(data, np.uint8)
        else:
            os.pwrite(self.fd, data, offset)

    def set_state(self, state: int) -> None:
        self._write(self.layout.header_offset + STATE_OFFSET, struct.pack("<I", state))

    def mark_ready(self) -> None:
        self.set_state(STATE_READY)

    def prefault(self, threads: int = 1,
                 spans: Sequence[tuple[int, int]] | None = None) -> None:
        """Map the pages of ``spans`` (page-aligned (offset, length); all by
        default) into this process's page tables now, writable, by
        ``threads`` threads in parallel: a copy into the table then takes no
        page fault (84% of a 4 KiB-page load was faults).  A hugetlb table's
        pages are already mapped where they were populated; a peer's are
        mapped the same way here."""
        for offset, length in spans or [(0, self.mapping.length)]:
            if length > 0:
                _parallel_chunks(length, self.mapping.page_size, threads,
                                 functools.partial(self._populate, offset))

    def seal(self) -> None:
        """Read-only from now on (a loaded table is never written again)."""
        self.mapping.seal()

    def write_progress(self, slot: int, value: int) -> None:
        """This loader's progress counter (the others watch it advance)."""
        if not 0 <= slot < MAX_LOADERS:
            raise StorageError(f"loader slot {slot} is outside 0..{MAX_LOADERS - 1}")
        self._write(self.layout.header_offset + PROGRESS_OFFSET + slot * SLOT.size,
                    SLOT.pack(value))

    def read_progress(self) -> tuple[int, ...]:
        data = os.pread(self.fd, MAX_LOADERS * SLOT.size,
                        self.layout.header_offset + PROGRESS_OFFSET)
        return tuple(v for (v,) in SLOT.iter_unpack(data))

    @property
    def state(self) -> int:
        return self.read_header().state

    def region(self, name: str) -> np.ndarray:
        """uint8 view of one region (exactly its length, not the page padding)."""
        r = self.layout.region(name)
        return self.mapping.array(r.offset, r.length)

    # -------------------------------------------------------- hand-over --
    def hand_over(self, directory: str) -> str:
        """Hand this table's descriptor to whoever of our uid (or root) asks
        at a socket of this process's in ``directory`` (fdhandover), until
        close; the socket's path."""
        if self._holder is None:
            answer = weakref.WeakMethod(self._hand_out)  # the socket keeps no table alive

            def hand_out(request: serviceclient.TableRequest) -> tuple[dict, int | None]:
                method = answer()
                if method is None:
                    return fdhandover.refusal("no_such_table", "the table was closed"), None
                return method(request)
            self._holder = fdhandover.Holder(directory, hand_out)
            weakref.finalize(self, self._holder.close)
        return self._holder.path

    @property
    def handover_directory(self) -> str | None:
        """Where a late process gets this table (``hand_over``), or None."""
        return None if self._holder is None else self._holder.directory

    def _hand_out(self, request: serviceclient.TableRequest) -> tuple[dict, int | None]:
        """A new descriptor for a request naming this table: read-write
        while it loads (the members' loaders map it writable), read-only
        once READY."""
        header = self.read_header()
        asked = (request.fingerprint, request.key, request.page_size)
        if asked != (header.fingerprint, header.key, self.layout.page_size):
            return fdhandover.refusal(
                "mismatch", f"this socket hands over {header.key} of spec "
                f"{header.fingerprint.hex()[:16]} on {self.layout.page_size}-byte pages; asked "
                f"for {request.key} of spec {request.fingerprint.hex()[:16]} on "
                f"{request.page_size}-byte pages"), None
        ready = header.state == STATE_READY
        fd = read_only_descriptor(self.fd) if ready else os.dup(self.fd)
        return {"ok": True, "table": {"state": header.state,
                                      "bytes": self.layout.file_size}}, fd

    # ------------------------------------------------------------- end --
    def unlink(self) -> None:
        """Remove the path; the mappings keep the memory alive."""
        if self.owner and not self.unlinked and not self.path.startswith("memfd:"):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.unlinked = True

    def _populate(self, offset: int, start: int, length: int) -> None:
        native.madvise(self.mapping, native.MADV_POPULATE_WRITE, offset + start, length)

    def close(self) -> None:
        """Stop handing over, unmap and close (idempotent).  The creator
        also unlinks."""
        if self._holder is not None:
            self._holder.close()
        if self.owner:
            self.unlink()
        self.mapping.close()  # idempotent; the object stays, closed
        self._fd_closer()  # (once)
        self.fd = -1

    def __enter__(self) -> BackingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map_new(fd: int, layout: Layout, directory: str | None) -> native.Mapping:
    """The creator's mapping; on hugetlb, mmap reserves the pages, so ENOMEM
    there is the pool (or the mount) running out: a CapacityError."""
    try:
        return native.Mapping(fd, layout.file_size, page_size=layout.page_size)
    except SyscallError as exc:
        if exc.errno != errno.ENOMEM or not hugepages.is_huge(layout.page_size):
            raise
        raise hugepages.out_of_pages(layout.file_size, layout.page_size, directory,
                                     "mmap") from exc


def _check_room(layout: Layout, directory: str | None, placement: RangePolicy | None,
                topology: Topology | None) -> None:
    """Step 1: the directory, the plan and the memory (or the huge page
    pool) are checked before anything is allocated."""
    page = layout.page_size
    if directory is not None:
        check_directory_room(directory, layout)
    elif not hugepages.is_huge(page):
        check_shmem_thp()
    if placement is not None:
        placement.validate(layout.file_size, topology or Topology.detect(), page)
    per_node = placement.bytes_per_node() if placement is not None else None
    if hugepages.is_huge(page):
        hugepages.check_pool(layout.file_size, page, per_node)
    else:
        check_memory(layout.file_size, per_node)


def _populate(fd: int, mapping: native.Mapping, path: str,
              progress: Callable[[int, int], None] | None = None, threads: int = 1) -> None:
    """Allocate every page now, where the policy says, in chunks (progress
    after each).  tmpfs: fallocate (the policy is on the file; it holds the
    inode lock, so one thread).  hugetlb: fallocate ignores a mapping's
    policy, so the pages are written in through this bound mapping
    (MADV_POPULATE_WRITE), by ``threads`` threads: zero-filling is the cost,
    and it scales with cores."""
    huge = hugepages.is_huge(mapping.page_size)

    def one(start: int, length: int) -> None:
        if huge:
            native.madvise(mapping, native.MADV_POPULATE_WRITE, start, length)
        else:
            native.fallocate(fd, start, length, path)
    _parallel_chunks(mapping.length, mapping.page_size, threads if huge else 1, one, progress)


def _parallel_chunks(total: int, page: int, threads: int, fn: Callable[[int, int], None],
                     progress: Callable[[int, int], None] | None = None) -> None:
    """fn(start, length) over [0, total) in page-aligned chunks, by
    ``threads`` threads; progress(done, total) after each chunk."""
    chunk = max(page, POPULATE_CHUNK // page * page)

    def one(start: int) -> int:
        length = min(chunk, total - start)
        fn(start, length)
        return length
    for_each_chunk(range(0, total, chunk), one, threads=threads, total=total, progress=progress,
                   name="numa-engram-populate")


SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def seal_contents(fd: int) -> bool:
    """Seal a loaded memfd against any write, growth or shrink, for good
    (True); False where the kernel refuses (a hugetlb memfd on an older
    kernel, a file that is no memfd, a writable mapping still alive): the
    table is then handed out through read-only descriptors only."""
    try:
        held = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if held & SEALS == SEALS:
            return True  # sealed before (a descriptor adopted from the fd store)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EINVAL, errno.EPERM):
            raise
        return False
    return True


def read_only_descriptor(fd: int) -> int:
    """A new read-only open file description of the same file (through
    /proc/self/fd): whoever receives it can map it, never write it."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _create_exclusive(directory: str | None, page_size: int) -> tuple[str, int]:
    if directory is None:
        name = PREFIX + secrets.token_hex(8)
        try:
            fd = os.memfd_create(name, hugepages.memfd_flags(page_size))
        except OSError as exc:
            raise StorageError(f"memfd_create with {hugepages.name_of(page_size)} pages "
                               f"failed: {exc.strerror}") from exc
        return f"memfd:{name}", fd
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


def _new_header(layout: Layout, fingerprint: bytes, key: ShardKey,
                placement: RangePolicy | None) -> Header:
    if len(fingerprint) != 32:
        raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
    pid = os.getpid()
    plan = placement.to_dict() if placement is not None else None
    return Header(FORMAT_VERSION, STATE_CREATING, pid, os.geteuid(),
                  procfs.start_time(pid) or 0, procfs.boot_id(), fingerprint, layout, key,
                  plan)


def _name_of(fd: int) -> str:
    """What a descriptor is called in reports: a memfd's name (as its
    creator's ``path``), else 'fd N'."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
    if target.startswith("/memfd:"):
        return target[1:].removesuffix(" (deleted)")
    return f"fd {fd}"


def _remove(path: str, fd: int) -> None:
    if not path.startswith("memfd:"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.close(fd)


def read_header(fd: int, where: str, file_size: int) -> Header:
    """The header in the last ``HEADER_BYTES`` of a file of ``file_size``
    bytes; a file of an older format (its header at the start) is an
    OldFormatError saying so."""
    if file_size < HEADER_BYTES:
        raise StorageError(f"{where} is too short ({file_size} bytes) to be a numa_engram "
                           "backing file")
    data = os.pread(fd, HEADER_BYTES, file_size - HEADER_BYTES)
    if data[:8] != MAGIC:
        old = older_format(os.pread(fd, 12, 0), where) \
            if file_size >= 2 * native.PAGE_SIZE else None  # (a header page and a region)
        if old is not None:
            raise old
        raise StorageError(f"{where} is not a numa_engram backing file, or is truncated (no "
                           f"header in its last {HEADER_BYTES} bytes)")
    return Header.unpack(data, where)


def _open_existing(path: str, writable: bool) -> int:
    # O_NONBLOCK: a FIFO (or device) at the path must not block the open;
    # _check_file refuses anything but a regular file right after
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | \
        os.O_NONBLOCK
    try:
        return os.open(path, flags)
    except OSError as exc:
        if os.path.islink(path):
            raise StorageError(f"{path} is a symlink; refusing to follow it") from exc
        if exc.errno == 13:
            raise StorageError(f"{path}: permission denied; a table is readable only by the "
                               "user that created it (mode 0600): run as that user") from exc
        raise StorageError(f"cannot open {path}: {exc.strerror}") from exc


def check_layout(found: Layout, expected: Layout, where: str) -> None:
    """A header's layout must be exactly the one the spec and shard imply:
    a corrupt or foreign header is refused naming the first field that differs."""
    if found.page_size != expected.page_size:
        raise StorageError(f"{where} header: page size {found.page_size}, expected "
                           f"{expected.page_size}")
    if found.file_size != expected.file_size:
        raise StorageError(f"{where} header: file size {found.file_size}, expected "
                           f"{expected.file_size} for this spec and shard")
    if len(found.regions) != len(expected.regions):
        raise StorageError(f"{where} header: {len(found.regions)} regions, expected "
                           f"{len(expected.regions)}")
    for got, want in zip(found.regions, expected.regions):
        for name in ("name", "offset", "length"):
            if getattr(got, name) != getattr(want, name):
                raise StorageError(f"{where} header: region {want.name!r} {name} is "
                                   f"{getattr(got, name)!r}, expected {getattr(want, name)!r}; "
                                   "a corrupt header or a table of another shape")


def _check_file(fd: int, where: str, fingerprint: bytes | None,
                file_size: int | None, key: ShardKey | None = None,
                owner_uid: int | None = None) -> Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{where} is not a regular file")
    owner = os.geteuid() if owner_uid is None else owner_uid
    if st.st_uid != owner:
        raise StorageError(f"{where} is owned by uid {st.st_uid}, not by uid {owner}; only "
                           "the creator's user (or a table service it trusts) may attach")
    header = read_header(fd, where, st.st_size)
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
