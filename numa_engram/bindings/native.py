"""Typed Python over the compiled cffi module (the only importer of it).

Every wrapper checks the C return value here and raises ``SyscallError``
naming the call, its important arguments and the errno name, so no caller
ever looks at errno.  No torch here: the placement tools import this.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import CapacityError, StorageError, SyscallError

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
MFD_CLOEXEC, MFD_HUGETLB, MFD_HUGE_SHIFT = lib.MFD_CLOEXEC, lib.MFD_HUGETLB, lib.MFD_HUGE_SHIFT
_MADV_NAMES = {
    MADV_DONTNEED: "MADV_DONTNEED",
    MADV_NOHUGEPAGE: "MADV_NOHUGEPAGE",
    MADV_POPULATE_READ: "MADV_POPULATE_READ",
    MADV_POPULATE_WRITE: "MADV_POPULATE_WRITE",
}
_MPOL_NAMES = {MPOL_DEFAULT: "MPOL_DEFAULT", MPOL_PREFERRED: "MPOL_PREFERRED",
               MPOL_BIND: "MPOL_BIND", MPOL_INTERLEAVE: "MPOL_INTERLEAVE"}
_BITS_PER_LONG = 64
MAX_NODE_ID = 1 << 16  # far above CONFIG_NODES_SHIFT=10; bounds the mask we allocate


def _raise(call: str, detail: str = "", hint: str = "") -> None:
    raise SyscallError(call, ffi.errno, detail, hint)


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
            _raise("mmap", f"fd={fd} length={length} MAP_SHARED writable={writable}")
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
            _raise("mprotect", f"PROT_READ length={self.length}")
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
        _raise("madvise", f"{name} offset={offset} length={length}", hint)


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
        _raise("mbind", f"{_MPOL_NAMES.get(mode, mode)} nodes={node_set} offset={offset} "
               f"length={length} flags={flags}", hint)


def node_of_address(mapping: Mapping, offset: int) -> int:
    """get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR): the node of the page (faults it in)."""
    mode = ffi.new("int *")
    if lib.ne_get_mempolicy(mode, ffi.NULL, 0, mapping.pointer(offset),
                            MPOL_F_NODE | MPOL_F_ADDR) != 0:
        _raise("get_mempolicy", f"MPOL_F_NODE|MPOL_F_ADDR offset={offset}")
    return int(mode[0])


def policy_of_address(mapping: Mapping, offset: int,
                      max_nodes: int = 1024) -> tuple[int, list[int]]:
    """get_mempolicy(MPOL_F_ADDR): the policy mode and node set of a range."""
    mode = ffi.new("int *")
    words = max_nodes // _BITS_PER_LONG
    mask = ffi.new("unsigned long[]", words)
    if lib.ne_get_mempolicy(mode, mask, words * _BITS_PER_LONG, mapping.pointer(offset),
                            MPOL_F_ADDR) != 0:
        _raise("get_mempolicy", f"MPOL_F_ADDR offset={offset}")
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
        _raise("move_pages", f"query offset={offset} length={length}")
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
        _raise("statvfs", f"path={path}")
    return int(free[0]), int(total[0])


TMPFS_MAGIC, HUGETLBFS_MAGIC = lib.TMPFS_MAGIC, lib.HUGETLBFS_MAGIC  # <linux/magic.h>


def statfs_type(path: str) -> int:
    """The magic number of the file system holding path (TMPFS_MAGIC, ...)."""
    fs_type = ffi.new("int64_t *")
    if lib.ne_statfs_type(path.encode(), fs_type) != 0:
        _raise("statfs", f"path={path}")
    return int(fs_type[0]) & 0xFFFFFFFF


# ------------------------------------------------------------- kernels --

def ids_args(ids: np.ndarray) -> tuple[Any, int]:
    """The kernel's view of int64 ids and their row stride in ids: the
    buffer of contiguous ones (the cheap path), the first element's address
    of a strided view (a token's columns adjacent, tokens apart).  One call
    for both (the decode budget, docs/design.md)."""
    try:  # the common case without a flags check: a contiguous array's buffer
        address = ffi.from_buffer(ids)
    except ValueError:  # numpy's "not C-contiguous"
        address = ffi.cast("void *", ids.ctypes.data)
    return address, ids.strides[0] // 8 if ids.shape[0] > 1 else ids.shape[1]


def kernel_outputs(out: Any, buffer: Any = None) -> tuple[Any, Any]:
    """The kernel's (rows, scales) of an output's bits: BF16 rows (scales
    NULL; ``buffer``: their buffer, when the caller made it once), or a
    packed (rows, scales) pair."""
    if buffer is not None:
        return buffer, ffi.NULL
    if isinstance(out, tuple):
        return ffi.from_buffer(out[0]), ffi.from_buffer(out[1])
    return ffi.from_buffer(out), ffi.NULL


def _ptr(array: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(array))


def first_bad_id(ids: np.ndarray, col0: int, sizes: np.ndarray,
                 id_base: np.ndarray | None) -> int:
    """Flat (token * heads + head) index of the first id of columns
    ``col0 ..`` that is neither -1 nor inside its head's range; -1 if none."""
    if ids.shape[0] == 0:
        return -1
    address, stride = ids_args(ids)
    return int(lib.ne_first_bad_id(ffi.cast("int64_t *", address) + col0, ids.shape[0], stride,
                                   len(sizes), _ptr(sizes, "int64_t *"),
                                   ffi.NULL if id_base is None else _ptr(id_base, "int64_t *")))


# this process's pid, renewed in a forked child: a pool's threads belong to
# the process that made them (os.getpid() per lookup would be a syscall each)
_this_process = [os.getpid()]
# every ShardKernel, so that a forked child's forget their parent's binding
_kernels: weakref.WeakSet[ShardKernel] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _shared_lock
    _this_process[0] = os.getpid()
    _shared_lock = threading.RLock()  # (a thread the child lacks may have held it)
    _shared.clear()  # the parent's pools have no threads here
    for kernel in list(_kernels):
        kernel.forget_binding()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Workers:
    """Lookup threads kept alive between calls (``ne_pool``), each bound to
    the CPUs ``cpus`` (the rows' node: the kernel puts each on an idle one);
    a call's caller runs one part itself, so ``threads`` workers serve calls
    of ``threads + 1``.  Stopped by ``close()`` or when dropped.  A forked
    child's copy has no threads: ``usable`` is False there (the
    owner makes a new pool), and dropping it only frees the memory."""

    def __init__(self, threads: int, cpus: Sequence[int] = ()) -> None:
        cpu_arr = np.asarray(list(cpus), dtype=np.int32)
        pool = lib.ne_pool_new(threads, _ptr(cpu_arr, "int *") if len(cpu_arr) else ffi.NULL,
                               len(cpu_arr))
        if pool == ffi.NULL:
            _raise("pthread_create", f"a pool of {threads} lookup threads")
        self.pid = _this_process[0]
        self.pool = ffi.gc(pool, lib.ne_pool_free)
        self.users = 0  # kernels using them (shared_workers)

    @property
    def usable(self) -> bool:
        return self.pool is not None and self.pid == _this_process[0]

    def close(self) -> None:
        """Stop and join the threads (idempotent)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            ffi.gc(pool, None)  # detach the destructor: freed here, once
            lib.ne_pool_free(pool)


# Lookup threads shared by this process's kernels that ask for as many on
# the same CPUs (a node's tables: one per layer): a step looks up its layers
# one after another, and the second finds the workers the first woke still
# spinning instead of waking them again (a futex wake-up and an IPI, tens of
# us in a VM guest; measured, 2 layers of 64 tokens: 0.78-0.90x the step's
# time with a pool each), and a node's tables run one set of workers, not
# one per table.  Counted: the last kernel to let go stops them.
_shared: dict[tuple[int, tuple[int, ...]], Workers] = {}
# reentrant: a kernel collected by the garbage collector (an allocation
# under the lock may run it) lets go of its workers from inside
_shared_lock = threading.RLock()


def shared_workers(threads: int, cpus: Sequence[int]) -> Workers:
    """This process's ``Workers`` of ``threads`` threads bound to ``cpus``,
    made by the first caller, counted per caller: ``release_workers`` when
    done."""
    key = (threads, tuple(cpus))
    with _shared_lock:
        workers = _shared.get(key)
        if workers is None or not workers.usable:
            workers = _shared[key] = Workers(threads, cpus)
        workers.users += 1
        return workers


def release_workers(workers: Workers) -> None:
    """One caller of ``shared_workers`` is done; the last one stops the
    threads."""
    with _shared_lock:
        workers.users -= 1
        if workers.users > 0:
            return
        for key, held in list(_shared.items()):
            if held is workers:
                del _shared[key]
    if workers.usable:
        workers.close()


@dataclass(frozen=True)
class Geometry:
    """A shard's fixed lookup arguments, cast for the kernel once (at create
    or attach) into one ``struct ne_geometry``, so a call only adds its ids
    and output: the rows (weights, scales), each head's first shard row and
    bucket count, and the head's first global row for ``id_format="global"``
    (NULL: bucket ids only)."""

    struct: Any  # struct ne_geometry *
    n_heads: int
    keep: tuple  # the arrays the pointers point into

    @classmethod
    def of(cls, weights: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
           sizes: np.ndarray, global_base: np.ndarray | None, block: int) -> Geometry:
        offs = np.ascontiguousarray(offsets, dtype=np.int64)
        counts = np.ascontiguousarray(sizes, dtype=np.int64)
        base = None if global_base is None else np.ascontiguousarray(global_base, dtype=np.int64)
        struct = ffi.new("struct ne_geometry *", {
            "weights": _ptr(weights, "uint8_t *"), "scales": _ptr(scales, "uint8_t *"),
            "dim": weights.shape[1], "block": block, "n_heads": len(counts),
            "head_offsets": _ptr(offs, "int64_t *"), "bucket_sizes": _ptr(counts, "int64_t *"),
            "id_base": ffi.NULL if base is None else _ptr(base, "int64_t *")})
        return cls(struct, len(counts), (weights, scales, offs, counts, base))


def cpu_list(cpus: Sequence[int]) -> tuple[Any, int]:
    """(``int *`` of the CPUs, their count) for ``run_geometry_lookup``,
    made once per CPU set: (NULL, 0) for none."""
    if not len(cpus):
        return ffi.NULL, 0
    return ffi.from_buffer("int[]", np.asarray(list(cpus), dtype=np.int32)), len(cpus)


NO_CPUS = (ffi.NULL, 0)


@dataclass(frozen=True)
class Tuning:
    """A kernel's thresholds (``struct ne_tuning``; lookup.h says what each
    decides), for benchmarks and tests: bound with the kernel, so a running
    call never sees another's change.  The defaults are the measured ones."""

    small_rows: int = lib.NE_SMALL_ROWS
    split_rows: int = lib.NE_SPLIT_ROWS
    job_rows: int = lib.NE_JOB_ROWS
    stream_bytes: int = lib.NE_STREAM_BYTES
    prefetch_ahead: int = lib.NE_PREFETCH_AHEAD
    prefetch_hint: int = lib.NE_PREFETCH_HINT

    def struct(self) -> Any:
        """The ``struct ne_tuning *`` of these values; ValueError naming
        the bounds when one is outside them."""
        made = ffi.new("struct ne_tuning *", vars(self))
        if lib.ne_tuning_check(made) != 0:
            raise ValueError(f"tuning {self}: small_rows must be in 0..{lib.NE_MAX_SMALL_ROWS}, "
                             f"split_rows >= 1, job_rows in 1..{lib.NE_SHARE_ROWS}, "
                             f"stream_bytes >= 0, prefetch_ahead in "
                             f"0..{lib.NE_MAX_PREFETCH_AHEAD}, prefetch_hint in 0..3")
        return made


def run_geometry_lookup(geom: Geometry, ids: np.ndarray, col0: int, global_ids: bool, out: Any,
                        threads: int, cpus: tuple[Any, int] = NO_CPUS,
                        tuning: Tuning | None = None) -> tuple[int, int, int]:
    """The kernel (GIL released) over a shard's ``Geometry``, for ids from
    column ``col0``, once: ``out`` BF16 bits, or (FP8 rows, scales) for the
    packed gather, on the caller and fresh threads (a table keeps its
    threads: ``ShardKernel``).  It checks every id as it reads it (once), so
    ids another thread changes meanwhile never make it read outside the
    table; bad ones give zero rows.  ``cpus`` from ``cpu_list``.  Returns
    (bad ids, flat index of the first, its value)."""
    kernel = ShardKernel(geom, threads, col0=col0, persistent=False, tuning=tuning)
    kernel.bind(cpus)
    return kernel(ids, global_ids, out)


class TableState:
    """A table's ``struct ne_table_state``: the kernel counts the table's
    lookups there (rows, time in ``bounds_s`` buckets) and refuses them once
    ``close()`` ran; shared by every ``ShardKernel`` of the table."""

    def __init__(self, bounds_s: Sequence[float]) -> None:
        self.struct = ffi.new("struct ne_table_state *")
        if len(bounds_s) != len(self.struct.bounds_ns):
            raise ValueError(f"{len(bounds_s)} latency bounds; the kernel counts "
                             f"{len(self.struct.bounds_ns)}")
        for i, bound in enumerate(bounds_s):
            self.struct.bounds_ns[i] = round(bound * 1e9)

    def close(self) -> None:
        """Refuse later lookups and wait for the running ones (GIL released)."""
        lib.ne_table_close(self.struct)

    def counts(self) -> tuple[int, int, float, list[int]]:
        """(lookups, rows, seconds, per-bucket counts) so far."""
        st = self.struct
        return st.lookups, st.rows, st.nanos / 1e9, list(st.buckets)


class ShardKernel:
    """One shard's lookup kernel with all but the ids and the output bound
    once into a ``struct ne_kernel``: its ``Geometry``, the first id column
    it reads (``col0``), the threads a call may use, the CPUs they are bound
    to and, for more than one thread, the persistent ``Workers`` (made at
    the first call, and again in a forked child, whose copy has no
    threads; ``persistent=False``: fresh threads per call instead) and the
    table's ``TableState`` (``state``: its lookups counted, refused once it
    is closed).  ``bound`` is that struct once a call (or ``bind()``) made
    it in this process: None before, after ``close()`` and in a forked
    child.  Every lookup goes through ``run`` (``ShardRows`` calls it with
    ids and outputs already cast).  After ``close()`` a call raises
    StorageError."""

    def __init__(self, geometry: Geometry, threads: int, cpus: Sequence[int] = (),
                 col0: int = 0, *, persistent: bool = True,
                 state: TableState | None = None, tuning: Tuning | None = None) -> None:
        self.geometry, self.threads, self.cpus = geometry, max(1, int(threads)), tuple(cpus)
        self.col0, self.persistent, self.state = int(col0), persistent, state
        # checked here, bound with the struct: NULL for the defaults
        self._tuning = ffi.NULL if tuning is None else tuning.struct()
        self.closed = False
        self.workers: Workers | None = None  # shared_workers' (persistent, > 1 thread)
        self._release: weakref.finalize | None = None  # lets go of them, once
        self.bound: Any = None  # struct ne_kernel * of this process
        self._keep: tuple = ()  # what bound points into
        self._lock = threading.Lock()
        _kernels.add(self)

    def __call__(self, ids: np.ndarray, global_ids: bool, out: Any,
                 out_buffer: Any = None) -> tuple[int, int, int]:
        """``run_geometry_lookup`` on this shard's threads (``out_buffer``:
        the kernel's buffer of a BF16 ``out``, when the caller keeps one)."""
        rows, scales = kernel_outputs(out, out_buffer)
        address, stride = ids_args(ids)
        bad = self.run(address, ids.shape[0], stride, global_ids, rows, scales)
        if bad == 0:
            return _NO_BAD_IDS
        return self.bad_ids(bad, ids.shape[0])

    def run(self, address: Any, tokens: int, stride: int, global_ids: bool, rows: Any,
            scales: Any = ffi.NULL) -> int:
        """The kernel over ids already cast (``ids_args``) into outputs
        already cast: the count of bad ids, 0 for none, or a failure
        (``bad_ids`` says which): the one place Python calls ``ne_lookup``."""
        bound = self.bound
        if bound is None:
            bound = self.bind()
        return lib.ne_lookup(bound, address, tokens, stride, global_ids, rows, scales)

    def bad_ids(self, bad: int, tokens: int) -> tuple[int, int, int]:
        """(bad ids, flat index of the first, its value); raises when the
        call failed (-1: no thread or no scratch; -2: the table is closed)."""
        if bad == -2:
            raise StorageError("the table is closed")
        if bad < 0:
            _check_lookup_rc(bad, tokens, self.geometry.n_heads, self.threads)
        first = ffi.new("int64_t[2]")
        lib.ne_last_bad(first)  # this thread's: the call above was its last
        return bad, first[0], first[1]

    def bind(self, cpus: tuple[Any, int] | None = None) -> Any:
        """The ``struct ne_kernel`` of this process, its workers made first
        (``cpus``: what ``cpu_list`` gave, when the caller has it)."""
        with self._lock:
            if self.closed:  # (no new workers for a closed table's late caller)
                raise StorageError("the table is closed")
            if self.bound is None:
                cpu_arg = cpus or cpu_list(self.cpus)
                pool = ffi.NULL
                if self.threads > 1 and self.persistent:  # the caller runs one part itself
                    self.workers = shared_workers(self.threads - 1, self.cpus)
                    # (a kernel dropped without close(): a table's setter
                    # lets go of it while other threads may still look up)
                    self._release = weakref.finalize(self, release_workers, self.workers)
                    pool = self.workers.pool
                bound = ffi.new("struct ne_kernel *", {
                    "g": self.geometry.struct, "col0": self.col0, "n_threads": self.threads,
                    "cpus": cpu_arg[0], "n_cpus": cpu_arg[1], "pool": pool,
                    "state": ffi.NULL if self.state is None else self.state.struct,
                    "tuning": self._tuning})
                # the struct points into these: they live as long as it does
                self._keep = (cpu_arg, pool)
                self.bound = bound
            return self.bound

    def forget_binding(self) -> None:
        """In a forked child: the parent's struct names its pool, whose
        threads the child lacks (its copy is never stopped, only freed), and
        the lock may have been held by a thread the child lacks; the next
        call binds anew."""
        self._lock = threading.Lock()
        self.bound = None
        if self._release is not None:  # (the parent's: nothing to let go of here)
            self._release.detach()
        self.workers = self._release = None

    def close(self) -> None:
        """Let go of the workers (the last kernel using them stops them; a
        forked child's copy has none); a later call raises StorageError."""
        with self._lock:
            release, self._release = self._release, None
            self.workers, self.bound = None, None
            self.closed = True
        if release is not None:
            release()


_NO_BAD_IDS = (0, -1, 0)


def _check_lookup_rc(rc: int, tokens: int, heads: int, threads: int) -> None:
    if rc != 0 and ffi.errno == errno.ENOMEM:
        raise MemoryError(f"lookup of {tokens} tokens x {heads} heads: no memory "
                          "for its scratch (up to 8 MiB per thread); free memory or pass "
                          "fewer tokens")
    if rc != 0:
        _raise("pthread_create", f"lookup with {threads} threads")


def ngram_hashes(rows: np.ndarray, pad_id: int, multipliers: np.ndarray, max_ngram: int,
                 primes: np.ndarray, n_head: int, threads: int = 1,
                 hardware_division: bool = False) -> np.ndarray:
    """int64 ``[n_rows, T, (max_ngram-1)*n_head]`` hashes of int64 ids
    ``[n_rows, T]`` (the formula is in hashing.py).  ``hardware_division``:
    the plain ``%`` path, the baseline the reciprocal path is benchmarked
    against (same results)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    multipliers = np.ascontiguousarray(multipliers, dtype=np.int64)
    primes = np.ascontiguousarray(primes, dtype=np.int64)
    if len(multipliers) < max_ngram or len(primes) != (max_ngram - 1) * n_head or \
            (primes <= 0).any():
        raise ValueError(f"{len(multipliers)} multipliers and {len(primes)} primes do not fit "
                         f"max_ngram {max_ngram} x {n_head} heads")
    out = np.empty((rows.shape[0], rows.shape[1], (max_ngram - 1) * n_head), dtype=np.int64)
    if out.size and lib.ne_ngram_hashes(
            _ptr(rows, "int64_t *"), rows.shape[0], rows.shape[1], pad_id,
            _ptr(multipliers, "int64_t *"), max_ngram, _ptr(primes, "int64_t *"), n_head,
            _ptr(out, "int64_t *"), threads, int(hardware_division)) != 0:
        _raise("pthread_create", f"hashing with {threads} threads")
    return out


MAX_POSITION: int = int(lib.NE_MAX_POSITION)


class WindowState:
    """A HashState's fixed arrays (history, next positions, scratch, the
    layers' multipliers, primes and head offsets, the token map and dead
    ids) in one ``struct ne_hash_state`` cast for the kernel once, so a
    decode step passes only its own few arrays.  The arrays are kept alive
    here and must not be replaced (only written in place)."""

    def __init__(self, hist: np.ndarray, next_pos: np.ndarray, scratch: dict[str, np.ndarray],
                 multipliers: np.ndarray, primes: np.ndarray, offsets: np.ndarray,
                 pad_id: int, n_head: int, token_map: np.ndarray | None = None,
                 dead_ids: np.ndarray | None = None) -> None:
        dead = np.ascontiguousarray(np.sort(dead_ids if dead_ids is not None else []),
                                    dtype=np.int64)
        self._keep = (hist, next_pos, scratch, multipliers, primes, offsets, token_map, dead)
        n_slots, n1 = hist.shape
        if n1 + 1 > 64:
            raise ValueError(f"max_ngram_size {n1 + 1} is above the kernel's 64")
        self.n_slots, self.n1 = n_slots, n1
        self.struct = ffi.new("struct ne_hash_state *", {
            "n_slots": n_slots, "n1": n1, "pad_id": pad_id, "n_layers": multipliers.shape[0],
            "n_head": n_head, "hist": _ptr(hist, "int64_t *"),
            "next_pos": _ptr(next_pos, "int64_t *"), "cur": _ptr(scratch["cur"], "int64_t *"),
            "cur_next": _ptr(scratch["cur_next"], "int64_t *"),
            "last": _ptr(scratch["last"], "int64_t *"),
            "multipliers": _ptr(multipliers, "int64_t *"), "primes": _ptr(primes, "int64_t *"),
            "offsets": _ptr(offsets, "int64_t *"),
            "token_map": ffi.NULL if token_map is None else _ptr(token_map, "int64_t *"),
            "map_len": 0 if token_map is None else len(token_map),
            "dead_ids": _ptr(dead, "int64_t *") if len(dead) else ffi.NULL,
            "n_dead": len(dead)})
        self.why = ffi.new("int64_t *")
        self.capacity = 0
        self.reserve(64)

    def reserve(self, n_tokens: int) -> None:
        """Scratch for steps of up to ``n_tokens`` tokens (compressed ids, raw
        windows, all-commit and no-commit flags), grown by doubling, cast
        once."""
        if n_tokens <= self.capacity:
            return
        capacity = max(n_tokens, 2 * self.capacity)
        self._scratch = (np.empty(capacity, np.int64), np.empty((capacity, self.n1 + 1), np.int64),
                         np.ones(capacity, np.uint8), np.zeros(capacity, np.uint8))
        ids, win, all_commit, no_commit = self._scratch
        st = self.struct
        st.ids, st.win = _ptr(ids, "int64_t *"), _ptr(win, "int64_t *")
        st.all_commit, st.no_commit = _ptr(all_commit, "uint8_t *"), _ptr(no_commit, "uint8_t *")
        st.capacity = self.capacity = capacity


def hash_step(state: WindowState, tokens: np.ndarray, mask: np.ndarray | None,
              slots: np.ndarray, positions: np.ndarray, commit: bool | np.ndarray,
              out: np.ndarray, global_rows: bool, threads: int = 1,
              out_buffer: Any = None) -> tuple[int, int]:
    """One HashState step in one kernel call: the tokens compressed through
    the state's token map and dead ids (``mask``: uint8 or bool, one per
    token; None: all take part), the sequential window pass (history
    updated in place on success), then every layer's hashes into ``out [T,
    layers, cols]``; ``commit`` a bool for every token, or a uint8 flag per
    token.  (-1, 0), or (index of the first bad token, 1 slot / 2 position
    not the slot's next / 3 position out of range), nothing changed then.
    ``out_buffer``: ``ffi.from_buffer(out)``, when the caller keeps one."""
    n_tokens = len(tokens)
    if n_tokens > state.capacity:
        state.reserve(n_tokens)
    if isinstance(commit, bool):
        flags, commit_all = ffi.NULL, commit
    else:
        flags, commit_all = ffi.from_buffer(commit), False
    bad = lib.ne_hash_step(state.struct, ffi.from_buffer(tokens),
                           ffi.NULL if mask is None else ffi.from_buffer(mask),
                           ffi.from_buffer(slots), ffi.from_buffer(positions), flags, commit_all,
                           n_tokens, global_rows,
                           ffi.from_buffer(out) if out_buffer is None else out_buffer, threads,
                           state.why)
    if bad == -2:
        _raise("pthread_create", f"hashing with {threads} threads")
    if bad >= 0:
        return bad, state.why[0]
    return -1, 0


def hash_window_batch(win: np.ndarray, pad_id: int, multipliers: np.ndarray,
                      primes: np.ndarray, offsets: np.ndarray | None, n_head: int,
                      out: np.ndarray, threads: int = 1) -> None:
    """Hash ids of raw windows ``win [T, n]`` for every layer at once into
    ``out [T, layers, cols]`` (global rows when ``offsets`` is given)."""
    n_tokens, n = win.shape
    if n > 64:
        raise ValueError(f"max_ngram_size {n} is above the kernel's 64")
    if n_tokens and lib.ne_hash_window_batch(
            _ptr(win, "int64_t *"), n_tokens, n, pad_id, _ptr(multipliers, "int64_t *"),
            _ptr(primes, "int64_t *"),
            ffi.NULL if offsets is None else _ptr(offsets, "int64_t *"), multipliers.shape[0],
            n_head, _ptr(out, "int64_t *"), threads) != 0:
        _raise("pthread_create", f"hashing with {threads} threads")


def ple_ids(ids: np.ndarray, query_start: np.ndarray, context: np.ndarray, eos: int,
            multipliers: np.ndarray, sizes: np.ndarray, offsets: np.ndarray,
            heads_per_ngram: int) -> np.ndarray:
    """int64 ``[T, n_layers, n_heads]`` PLE rows (model/plehashing.py has
    the rule) of int64 ``ids [T]`` in requests ``query_start [R + 1]``
    with ``context [R, n1]``; multipliers ``[n_layers, n1 + 1]``, sizes and
    offsets ``[n_layers, n_heads]``.  The caller checks every shape."""
    n_layers, n_heads = sizes.shape
    out = np.empty((ids.shape[0], n_layers, n_heads), dtype=np.int64)
    if out.size and lib.ne_ple_ids(
            _ptr(ids, "int64_t *"), ids.shape[0], _ptr(query_start, "int64_t *"),
            query_start.shape[0] - 1, _ptr(context, "int64_t *"), context.shape[1], eos,
            _ptr(multipliers, "int64_t *"), _ptr(sizes, "int64_t *"),
            _ptr(offsets, "int64_t *"), n_layers, n_heads, heads_per_ngram,
            _ptr(out, "int64_t *")) != 0:
        _raise("ne_ple_ids", "arguments the caller should have refused")
    return out


class PLEShard:
    """One PLE shard's fixed lookup arguments cast once (``struct
    ne_ple_shard``): a uint8 ``table [rows, row_bytes]`` holding rows
    ``row_start ..`` of a layer of ``total_rows``, the per-tensor ``scale``
    (a BF16 value: vLLM's ``rows.to(bf16) * scale.to(bf16)``; None: BF16
    rows), ``workers`` a large call is split over (with the caller).  Keeps
    the table and workers alive while it is."""

    def __init__(self, table: np.ndarray, row_start: int, total_rows: int,
                 scale: float | None, workers: Workers | None = None) -> None:
        self.table, self.workers = table, workers
        self.struct = ffi.new("struct ne_ple_shard *", {
            "table": _ptr(table, "uint8_t *") if table.size else ffi.NULL,
            "n_rows": table.shape[0], "row_bytes": table.shape[1], "row_start": row_start,
            "total_rows": total_rows, "scale": 0.0 if scale is None else scale,
            "pool": workers.pool if workers is not None and workers.usable else ffi.NULL})

    def rows(self, ids: np.ndarray, out: np.ndarray, scaled: bool) -> int:
        """``out[i]`` = row ``ids[i]`` (C-contiguous int64): BF16 bits of
        byte x scale (``scaled``) or the stored bytes; zeros for ids outside
        the shard.  Returns the position of the first id outside the layer
        (its row zeros too), or -1.  The caller checks ``out``'s size."""
        if not ids.shape[0]:
            return -1
        found = lib.ne_ple_lookup(self.struct, ffi.from_buffer("int64_t[]", ids), ids.shape[0],
                                  scaled, ffi.from_buffer(out))
        if found < -1:
            _raise("ne_ple_lookup", "a row of no bytes")
        return found
