"""Typed Python over the compiled cffi module (the only importer of it):
the core's loading and constants, and its syscall wrappers (mappings,
memory policies, page nodes, file systems); the kernels' wrappers are in
lookupkernel.py and hashkernels.py.

Every wrapper checks the C return value here and raises ``SyscallError``
naming the call, its important arguments and the errno name, so no caller
ever looks at errno.  No torch here: the placement tools import this.
"""

from __future__ import annotations

import errno
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CapacityError, CheckpointError, SyscallError

try:
    from .._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "numa_engram's C core is not built; install the package with "
        "'pip install -e .' (needs a C compiler and cffi)"
    ) from exc


def _core_version() -> str:
    try:
        return ffi.string(lib.ne_core_version()).decode()
    except AttributeError:  # a core without the version compiled in
        return "unknown (older)"


if _core_version() != __version__:
    raise ImportError(f"numa_engram's C core was built for version {_core_version()}, the "
                      f"package is {__version__}: a stale build; reinstall the package "
                      "('pip install -e .' in a checkout) so the core is rebuilt")

PAGE_SIZE: int = int(lib.ne_page_size())

# the kernel's values, compiled in from <linux/mempolicy.h> and <sys/mman.h>
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = lib.MPOL_DEFAULT, lib.MPOL_PREFERRED, lib.MPOL_BIND
MPOL_INTERLEAVE = lib.MPOL_INTERLEAVE
MPOL_F_NODE, MPOL_F_ADDR = lib.MPOL_F_NODE, lib.MPOL_F_ADDR
MADV_DONTNEED, MADV_NOHUGEPAGE = lib.MADV_DONTNEED, lib.MADV_NOHUGEPAGE
MADV_POPULATE_READ, MADV_POPULATE_WRITE = lib.MADV_POPULATE_READ, lib.MADV_POPULATE_WRITE
MADV_RANDOM, MADV_WILLNEED = lib.MADV_RANDOM, lib.MADV_WILLNEED
MFD_CLOEXEC, MFD_HUGETLB, MFD_HUGE_SHIFT = lib.MFD_CLOEXEC, lib.MFD_HUGETLB, lib.MFD_HUGE_SHIFT
_MADV_NAMES = {
    MADV_DONTNEED: "MADV_DONTNEED",
    MADV_NOHUGEPAGE: "MADV_NOHUGEPAGE",
    MADV_POPULATE_READ: "MADV_POPULATE_READ",
    MADV_POPULATE_WRITE: "MADV_POPULATE_WRITE",
    MADV_RANDOM: "MADV_RANDOM",
    MADV_WILLNEED: "MADV_WILLNEED",
}
_MPOL_NAMES = {MPOL_DEFAULT: "MPOL_DEFAULT", MPOL_PREFERRED: "MPOL_PREFERRED",
               MPOL_BIND: "MPOL_BIND", MPOL_INTERLEAVE: "MPOL_INTERLEAVE"}
_BITS_PER_LONG = 64
MAX_NODE_ID = 1 << 16  # far above CONFIG_NODES_SHIFT=10; bounds the mask we allocate


def raise_errno(call: str, detail: str = "", hint: str = "") -> None:
    """SyscallError for ``call`` with the errno the C call left."""
    raise SyscallError(call, ffi.errno, detail, hint)


def ptr(array: np.ndarray, ctype: str) -> Any:
    """``array``'s buffer as a C pointer of ``ctype``."""
    return ffi.cast(ctype, ffi.from_buffer(array))


class Mapping:
    """A MAP_SHARED mapping of a file.

    The memory is unmapped when the last Python object that can reach it
    (this mapping, or any numpy view made by ``array``) is gone, so a view
    kept past ``close()`` never points into unmapped memory.
    """

    def __init__(self, fd: int, length: int, writable: bool = True,
                 page_size: int = PAGE_SIZE) -> None:
        if length <= 0:
            raise ValueError(f"mapping length must be > 0, got {length}")
        if length % page_size:
            raise ValueError(f"mapping length {length} is not a multiple of the page size "
                             f"{page_size}")
        ptr = lib.ne_map_shared(fd, length, 1 if writable else 0)
        if ptr == ffi.NULL:
            raise_errno("mmap", f"fd={fd} length={length} MAP_SHARED writable={writable}")
        self._own(ptr, length, writable, page_size)

    def _own(self, ptr: object, length: int, writable: bool, page_size: int) -> None:
        """Hold the mapped range at ``ptr``: unmapped when the last object
        that can reach it is gone (the ``mapped`` state then says so)."""
        self.length = length
        self.writable = writable
        self.page_size = page_size  # 4 KiB, or the huge page size of a hugetlb file
        self.address = int(ffi.cast("uintptr_t", ptr))
        self._state = {"mapped": True}
        state = self._state

        def unmap(p: object) -> None:
            lib.ne_unmap(p, length)
            state["mapped"] = False

        self._ptr = ffi.gc(ptr, unmap, size=length)
        self._buffer = ffi.buffer(self._ptr, length)

    @property
    def mapped(self) -> bool:
        """False once the memory has really been unmapped."""
        return self._state["mapped"]

    def array(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """A uint8 numpy view of [offset, offset + length) of the mapping."""
        self._check_open()
        length = self.length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the mapping "
                             f"of {self.length} bytes")
        # a PROT_READ mapping: the view is built on a read-only buffer, so
        # numpy refuses writes (and refuses to make the view writable again)
        # instead of the process faulting
        buffer = self._buffer if self.writable else memoryview(self._buffer).toreadonly()
        return np.frombuffer(buffer, dtype=np.uint8, count=length, offset=offset)

    def seal(self) -> None:
        """Make the mapping read-only (views made after this are read-only
        too; a write through an older view would fault, so seal first)."""
        self._check_open()
        if lib.ne_protect_read(self._ptr, self.length) != 0:
            raise_errno("mprotect", f"PROT_READ length={self.length}")
        self.writable = False

    def keepalive(self) -> object:
        """An object that keeps the memory mapped while referenced (for
        holders that outlive this Mapping's close(), e.g. a CUDA
        registration)."""
        self._check_open()
        return self._ptr

    def pointer(self, offset: int = 0) -> object:
        self._check_open()
        return ffi.cast("char *", self._ptr) + offset

    def close(self) -> None:
        """Drop this object's hold on the memory (idempotent)."""
        self._buffer = None
        self._ptr = None

    def _check_open(self) -> None:
        if self._ptr is None:
            raise ValueError("mapping is closed")


def _check_range(mapping: Mapping, offset: int, length: int, call: str) -> None:
    page = mapping.page_size
    if offset % page or offset < 0 or length <= 0 or offset + length > mapping.length:
        raise ValueError(
            f"{call}: range [{offset}, {offset + length}) must be page-aligned "
            f"({page}) and inside the mapping of {mapping.length} bytes"
        )


def madvise(mapping: Mapping, advice: int, offset: int = 0, length: int | None = None) -> None:
    length = mapping.length - offset if length is None else length
    _check_range(mapping, offset, length, "madvise")
    if lib.ne_madvise(mapping.pointer(offset), length, advice) != 0:
        name = _MADV_NAMES.get(advice, str(advice))
        hint = "MADV_POPULATE_* needs Linux >= 5.14" if ffi.errno == errno.EINVAL else ""
        if ffi.errno in (errno.ENOMEM, errno.EFAULT) and advice == MADV_POPULATE_WRITE:
            # a hugetlb pool that runs dry fails populate with EFAULT (a later
            # touch would be SIGBUS): never let the caller get that far
            where = (f"the {mapping.page_size >> 20} MiB huge page pool is exhausted"
                     if mapping.page_size > PAGE_SIZE else "out of memory")
            raise CapacityError(f"populating {length} bytes at offset {offset} failed: "
                                f"{where}; reserve more pages or use a smaller table")
        raise_errno("madvise", f"{name} offset={offset} length={length}", hint)


def nodemask(nodes: Iterable[int]) -> tuple[object, int]:
    """A kernel node mask (array of unsigned long) and the maxnode to pass with it."""
    nodes = sorted(set(nodes))
    if not nodes:
        raise ValueError("empty node set: give at least one NUMA node")
    if nodes[0] < 0:
        raise ValueError(f"negative NUMA node {nodes[0]}")
    if nodes[-1] >= MAX_NODE_ID:
        raise ValueError(f"NUMA node {nodes[-1]} is beyond any kernel's node ids "
                         f"(< {MAX_NODE_ID}); name a node the host has")
    words = nodes[-1] // _BITS_PER_LONG + 1
    mask = ffi.new("unsigned long[]", words)
    for node in nodes:
        mask[node // _BITS_PER_LONG] |= 1 << (node % _BITS_PER_LONG)
    # maxnode counts bits + 1 (the kernel drops the last one)
    return mask, words * _BITS_PER_LONG + 1


def mbind(mapping: Mapping, offset: int, length: int, mode: int, nodes: Iterable[int],
          flags: int = 0) -> None:
    """Set the memory policy of a range; on tmpfs it is kept on the file itself."""
    _check_range(mapping, offset, length, "mbind")
    nodes = tuple(sorted(set(nodes)))
    if mode == MPOL_DEFAULT:
        mask, maxnode = ffi.NULL, 0
    else:
        mask, maxnode = nodemask(nodes)
    rc = lib.ne_mbind(mapping.pointer(offset), length, mode, mask, maxnode, flags)
    if rc != 0:
        hint = ("a node in the set does not exist or has no memory"
                if ffi.errno == errno.EINVAL else "")
        node_set = ",".join(map(str, nodes))  # numactl's form, as every message writes it
        raise_errno("mbind", f"{_MPOL_NAMES.get(mode, mode)} nodes={node_set} offset={offset} "
               f"length={length} flags={flags}", hint)


def node_of_address(mapping: Mapping, offset: int) -> int:
    """get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR): the node of the page (faults it in)."""
    mode = ffi.new("int *")
    if lib.ne_get_mempolicy(mode, ffi.NULL, 0, mapping.pointer(offset),
                            MPOL_F_NODE | MPOL_F_ADDR) != 0:
        raise_errno("get_mempolicy", f"MPOL_F_NODE|MPOL_F_ADDR offset={offset}")
    return int(mode[0])


def policy_of_address(mapping: Mapping, offset: int,
                      max_nodes: int = 1024) -> tuple[int, list[int]]:
    """get_mempolicy(MPOL_F_ADDR): the policy mode and node set of a range."""
    mode = ffi.new("int *")
    words = max_nodes // _BITS_PER_LONG
    mask = ffi.new("unsigned long[]", words)
    if lib.ne_get_mempolicy(mode, mask, words * _BITS_PER_LONG, mapping.pointer(offset),
                            MPOL_F_ADDR) != 0:
        raise_errno("get_mempolicy", f"MPOL_F_ADDR offset={offset}")
    nodes = [w * 64 + b for w in range(words) for b in range(64) if mask[w] >> b & 1]
    return int(mode[0]), nodes


def page_nodes(mapping: Mapping, offset: int, length: int) -> np.ndarray:
    """move_pages query: node of each page in the range (negative errno if unmapped)."""
    _check_range(mapping, offset, length, "move_pages")
    page = mapping.page_size
    count = (length + page - 1) // page
    status = np.empty(count, dtype=np.int32)
    ptr = ffi.cast("int *", ffi.from_buffer(status))
    if lib.ne_page_nodes(mapping.pointer(offset), length, page, ptr) != 0:
        raise_errno("move_pages", f"query offset={offset} length={length}")
    return status


def fallocate(fd: int, offset: int, length: int, path: str = "") -> None:
    """posix_fallocate: ENOSPC becomes CapacityError here, never a SIGBUS later."""
    if lib.ne_fallocate(fd, offset, length) != 0:
        err = ffi.errno
        if err == errno.ENOSPC:
            raise CapacityError(
                f"no space to allocate {length} bytes for {path or f'fd {fd}'}: the tmpfs is "
                "full; free space, enlarge it (mount -o remount,size=...) or use a smaller table"
            )
        raise SyscallError("posix_fallocate", err, f"fd={fd} offset={offset} length={length}")


def statvfs(path: str) -> tuple[int, int]:
    """(free bytes for unprivileged users, total bytes) of the file system holding path."""
    free = ffi.new("uint64_t *")
    total = ffi.new("uint64_t *")
    if lib.ne_statvfs(path.encode(), free, total) != 0:
        raise_errno("statvfs", f"path={path}")
    return int(free[0]), int(total[0])


TMPFS_MAGIC, HUGETLBFS_MAGIC = lib.TMPFS_MAGIC, lib.HUGETLBFS_MAGIC  # <linux/magic.h>


def statfs_type(path: str) -> int:
    """The magic number of the file system holding path (TMPFS_MAGIC, ...)."""
    fs_type = ffi.new("int64_t *")
    if lib.ne_statfs_type(path.encode(), fs_type) != 0:
        raise_errno("statfs", f"path={path}")
    return int(fs_type[0]) & 0xFFFFFFFF


# ------------------------------------------------- mapped checkpoint files --
NE_FAULTED: int = lib.NE_FAULTED  # a lookup kernel's result: a SIGBUS stopped it


class FileMapping(Mapping):
    """Page-aligned spans of files, each ``(fd, offset, length)``, mapped
    read-only (PROT_READ, MAP_SHARED, MADV_RANDOM) side by side in one
    reserved range: the page cache's own pages, evictable, nothing copied.
    ``describe_fault(offset)``: what a SIGBUS at that offset of the range
    means (a truncated file, named), for ``fault_error``.  Unmapped, like a
    ``Mapping``, when the last view of it is gone."""

    def __init__(self, spans: Sequence[tuple[int, int, int]],
                 describe_fault: Callable[[int], str] = str) -> None:
        length = sum(n for _, _, n in spans)
        if not spans or length <= 0 or any(o % PAGE_SIZE or n <= 0 or n % PAGE_SIZE
                                           for _, o, n in spans):
            raise ValueError(f"file spans must be page-aligned and not empty: {list(spans)}")
        base = lib.ne_reserve(length)
        if base == ffi.NULL:
            raise_errno("mmap", f"a reservation of {length} bytes")
        at = 0
        for fd, offset, n in spans:
            if lib.ne_map_file_at(ffi.cast("char *", base) + at, fd, offset, n) != 0:
                err = ffi.errno
                lib.ne_unmap(base, length)
                raise SyscallError("mmap", err, f"fd={fd} offset={offset} length={n} "
                                   "PROT_READ MAP_SHARED")
            at += n
        self._own(base, length, False, PAGE_SIZE)
        self.describe_fault = describe_fault
        _file_mappings.add(self)
        if lib.ne_guard_install() != 0:
            raise_errno("sigaction", "SIGBUS")


_file_mappings: weakref.WeakSet[FileMapping] = weakref.WeakSet()


def fault_error(kernel: str) -> CheckpointError:
    """The error of a lookup that ``kernel`` ended with NE_FAULTED: the
    mapped file under the faulting address named by its mapping."""
    address = int(lib.ne_last_fault())
    for mapping in list(_file_mappings):
        if mapping.mapped and mapping.address <= address < mapping.address + mapping.length:
            return CheckpointError(mapping.describe_fault(address - mapping.address))
    return CheckpointError(f"{kernel}: a page of a mapped file could not be read (SIGBUS at "
                           f"{address:#x}): its file was truncated under the table")


def rows_readahead(mapping: Mapping, offset: int, row_bytes: int, rows: np.ndarray,
                   advise: bool = True) -> tuple[int, int]:
    """(pages resident, pages) of rows ``rows`` (ascending int64) of the
    ``[.., row_bytes]`` array at ``offset`` of ``mapping``, counted with
    mincore before, and with ``advise`` those not resident asked for
    (MADV_WILLNEED over each run of pages)."""
    pages = ffi.new("int64_t *")
    if rows.shape[0] == 0:
        return 0, 0
    resident = lib.ne_rows_readahead(ffi.cast("uint8_t *", mapping.pointer(offset)), row_bytes,
                                     ptr(rows, "int64_t *"), rows.shape[0], int(advise), pages)
    if resident < 0:
        raise_errno("madvise", f"MADV_WILLNEED over {rows.shape[0]} rows of {row_bytes} bytes")
    return int(resident), int(pages[0])


def pages_resident(mapping: Mapping, offset: int = 0, length: int | None = None) -> int:
    """Pages of ``[offset, offset + length)`` of ``mapping`` in memory (mincore)."""
    length = mapping.length - offset if length is None else length
    _check_range(mapping, offset, length, "mincore")
    n = lib.ne_pages_resident(mapping.pointer(offset), length)
    if n < 0:
        raise_errno("mincore", f"length={length}")
    return int(n)
