"""Typed Python over the compiled cffi module (the only importer of it).

Every wrapper checks the C return value here and raises ``SyscallError``
naming the call, its important arguments and the errno name, so no caller
ever looks at errno.  No torch here: the placement tools import this.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

import numpy as np

from ._version import __version__
from .errors import CapacityError, LookupIdError, SyscallError

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "numa_engram's C core is not built; install the package with "
        "'pip install -e .' (needs a C compiler and cffi)"
    ) from exc


def _core_version() -> str:
    try:
        return ffi.string(lib.ne_core_version()).decode()
    except AttributeError:  # a core from before the version was compiled in
        return "unknown (older)"


if _core_version() != __version__:
    raise ImportError(f"numa_engram's C core was built for version {_core_version()}, the "
                      f"package is {__version__}: a stale build; reinstall the package "
                      "('pip install -e .' in a checkout) so the core is rebuilt")

PAGE_SIZE: int = int(lib.ne_page_size())

# the kernel's values, compiled in from <linux/mempolicy.h> and <sys/mman.h>
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND = lib.MPOL_DEFAULT, lib.MPOL_PREFERRED, lib.MPOL_BIND
MPOL_INTERLEAVE, MPOL_LOCAL = lib.MPOL_INTERLEAVE, lib.MPOL_LOCAL
MPOL_MF_STRICT, MPOL_MF_MOVE, MPOL_MF_MOVE_ALL = (lib.MPOL_MF_STRICT, lib.MPOL_MF_MOVE,
                                                  lib.MPOL_MF_MOVE_ALL)
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
        view = np.frombuffer(self._buffer, dtype=np.uint8, count=length, offset=offset)
        # a PROT_READ mapping: numpy refuses writes instead of the process faulting
        view.flags.writeable = self.writable
        return view

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
        _raise("mbind", f"{_MPOL_NAMES.get(mode, mode)} nodes={list(nodes)} offset={offset} "
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


TMPFS_MAGIC, HUGETLBFS_MAGIC = 0x01021994, 0x958458F6


def statfs_type(path: str) -> int:
    """The magic number of the file system holding path (TMPFS_MAGIC, ...)."""
    fs_type = ffi.new("int64_t *")
    if lib.ne_statfs_type(path.encode(), fs_type) != 0:
        _raise("statfs", f"path={path}")
    return int(fs_type[0]) & 0xFFFFFFFF


# ------------------------------------------------------------- kernels --

def check_hash_ids(hash_ids, n_cols: int | None = None) -> np.ndarray:
    """2-D ``[T, n_cols]`` int64 hash ids as a numpy array, without a copy (a
    CPU torch tensor is viewed through ``__array__``; rows may be strided,
    e.g. ``out[:, layer]`` of ``HashState.hash``; columns must be adjacent).
    int32 ids (as vLLM passes global rows) are widened, which copies.
    ``n_cols=None`` accepts any column count."""
    device = getattr(hash_ids, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise LookupIdError(f"hash ids are on {device}; the CPU lookup needs them on the CPU")
    ids = hash_ids if isinstance(hash_ids, np.ndarray) else np.asarray(hash_ids)
    if ids.dtype == np.int32:
        ids = ids.astype(np.int64)
    if ids.dtype != np.int64:
        raise LookupIdError(f"hash ids have dtype {ids.dtype}; pass int64 or int32 "
                            "(ids.astype(np.int64)) so no id can be truncated")
    if ids.ndim != 2 or (n_cols is not None and ids.shape[1] != n_cols):
        raise LookupIdError(f"hash ids have shape {list(ids.shape)}; expected "
                            f"[T, {n_cols or 'n_hash_cols'}] (one bucket index per hash column)")
    if ids.size and (ids.shape[0] > 1 and (ids.strides[0] % 8 or
                                           ids.strides[0] < 8 * ids.shape[1]) or
                     ids.shape[1] > 1 and ids.strides[1] != 8):
        raise LookupIdError(f"hash ids have strides {ids.strides}: a token's columns must be "
                            "adjacent and tokens must not overlap; call np.ascontiguousarray "
                            "(or .contiguous() on a tensor) first")
    return ids


def _row_stride(ids: np.ndarray) -> int:
    return ids.strides[0] // 8 if ids.shape[0] > 1 else ids.shape[1]


def _ids_ptr(ids: np.ndarray):
    """The ids' first element (a strided view is not a contiguous buffer)."""
    return ffi.cast("int64_t *", ids.ctypes.data)


def _ptr(array: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(array))


def check_ids_in_range(ids: np.ndarray, head_start: int, sizes: np.ndarray,
                       id_base: np.ndarray | None = None) -> None:
    """Every id of heads ``head_start ..`` is -1 (DEAD) or in its head's
    buckets (global rows: in ``[id_base[h], id_base[h] + sizes[h])``)."""
    if ids.shape[0] == 0:
        return
    bad = lib.ne_first_bad_id(_ids_ptr(ids) + head_start, ids.shape[0], _row_stride(ids),
                              len(sizes), _ptr(sizes, "int64_t *"),
                              ffi.NULL if id_base is None else _ptr(id_base, "int64_t *"))
    if bad >= 0:
        t, h = divmod(int(bad), len(sizes))
        raise LookupIdError(_bad_id_text(int(ids[t, head_start + h]), t, head_start + h,
                                         int(sizes[h]), id_base, h))


def _bad_id_text(value: int, token: int, column: int, size: int, id_base, h: int,
                 count: int = 1) -> str:
    low = 0 if id_base is None else int(id_base[h])
    what = "buckets" if id_base is None else "global rows"
    more = f" ({count} bad ids in all)" if count > 1 else ""
    return (f"hash id {value} at token {token}, column {column} is outside head {column}'s "
            f"{what} [{low}, {low + size}){more}; use -1 (DEAD_ID) for padding")


def gather_dequant(weights: np.ndarray, scales: np.ndarray, hash_ids: np.ndarray, *,
                   head_start: int, bucket_sizes, out: np.ndarray, head_offsets=None,
                   threads: int = 1, cpus=(), block: int = 32, dedup: bool = False,
                   id_base: np.ndarray | None = None) -> None:
    """The fused kernel: rows of heads ``head_start .. +len(bucket_sizes)`` of
    ``hash_ids [T, cols]`` gathered from uint8 ``weights``/``scales`` and
    written as BF16 bits into ``out`` (uint16 ``[T, heads, head_dim]``), or,
    packed, as stored into ``out = (rows uint8 [T, heads, head_dim], scales
    uint8 [T, heads, head_dim/block])``.
    Every id is checked as it is read (-1 gives a zero row); ``id_base``
    (each head's first global row) when the ids are global rows; GIL
    released."""
    ids = check_hash_ids(hash_ids)
    sizes = np.ascontiguousarray(bucket_sizes, dtype=np.int64)
    offsets = np.ascontiguousarray(
        np.concatenate(([0], np.cumsum(sizes)[:-1])) if head_offsets is None else head_offsets,
        dtype=np.int64)
    if not 0 <= head_start <= ids.shape[1] - len(sizes):
        raise LookupIdError(f"heads [{head_start}, {head_start + len(sizes)}) are not columns of "
                            f"hash ids with {ids.shape[1]} columns")
    if weights.shape[0] < int((offsets + sizes).max(initial=0)):
        raise ValueError(f"weights hold {weights.shape[0]} rows, heads need "
                         f"{int((offsets + sizes).max())}")
    if weights.shape[1] % block or scales.shape != (weights.shape[0], weights.shape[1] // block):
        raise ValueError(f"weights {weights.shape} and scales {scales.shape} do not match with "
                         f"{block} values per scale")
    shape = (ids.shape[0], len(sizes), weights.shape[1])
    _check_out(out, shape, block)
    if ids.shape[0] == 0:
        return
    if dedup and isinstance(out, tuple):
        raise ValueError("dedup=True needs the dequantised output (dequantize=True)")
    if dedup:  # read each distinct row once, then copy it where it repeats
        check_ids_in_range(ids, head_start, sizes, id_base)  # np.unique reads a copy
        cols = ids[:, head_start:head_start + len(sizes)]
        if id_base is not None:
            cols = np.where(cols >= 0, cols - id_base, -1)
        unique, inverse = np.unique(np.where(cols >= 0, cols + offsets, -1),
                                    return_inverse=True)
        staged = np.empty((len(unique), 1, weights.shape[1]), dtype=np.uint16)
        _run_lookup(weights, scales, np.ascontiguousarray(unique.reshape(-1, 1)), 0,
                    np.zeros(1, np.int64), np.array([weights.shape[0]], np.int64), None,
                    staged, threads, cpus, block)
        np.take(staged.reshape(len(unique), -1), inverse.reshape(-1), axis=0,
                out=out.reshape(-1, weights.shape[1]), mode="clip")
        return
    base = None if id_base is None else np.ascontiguousarray(id_base, dtype=np.int64)
    _run_lookup(weights, scales, ids, head_start, offsets, sizes, base, out, threads, cpus,
                block)


def _check_out(out, shape: tuple[int, ...], block: int) -> None:
    """uint16 BF16 bits ``shape``, or (uint8 rows ``shape``, uint8 scales)."""
    want = [(np.uint16, shape)] if not isinstance(out, tuple) else [
        (np.uint8, shape), (np.uint8, (*shape[:2], shape[2] // block))]
    arrays = out if isinstance(out, tuple) else (out,)
    for arr, (dtype, dims) in zip(arrays, want):
        if arr.dtype != dtype or arr.shape != dims or not arr.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous {np.dtype(dtype).name} {list(dims)}, got "
                             f"{arr.dtype} {list(arr.shape)}")


def _run_lookup(weights, scales, ids, col0, offsets, sizes, id_base, out, threads, cpus,
                block) -> None:
    """The kernel checks every id as it reads it (once): ids another thread
    changes meanwhile can never make it read outside the table.  ``out``:
    BF16 bits, or (FP8 rows, scales) for the packed gather."""
    cpu_arr = np.asarray(list(cpus), dtype=np.int32)
    bad = ffi.new("int64_t[3]")
    args = (_ptr(weights, "uint8_t *"), _ptr(scales, "uint8_t *"), weights.shape[1], block,
            _ids_ptr(ids) + col0, ids.shape[0], _row_stride(ids), len(offsets),
            _ptr(offsets, "int64_t *"), _ptr(sizes, "int64_t *"),
            ffi.NULL if id_base is None else _ptr(id_base, "int64_t *"))
    cpu_args = (threads, _ptr(cpu_arr, "int *") if len(cpu_arr) else ffi.NULL, len(cpu_arr), bad)
    if isinstance(out, tuple):
        rc = lib.ne_gather_fp8(*args, _ptr(out[0], "uint8_t *"), _ptr(out[1], "uint8_t *"),
                               *cpu_args)
    else:
        rc = lib.ne_lookup_bf16(*args, _ptr(out, "uint16_t *"), *cpu_args)
    if rc != 0:
        _raise("pthread_create", f"lookup with {threads} threads")
    if bad[0]:
        t, h = divmod(int(bad[1]), len(sizes))
        raise LookupIdError(_bad_id_text(int(bad[2]), t, col0 + h, int(sizes[h]), id_base, h,
                                         int(bad[0])))


def ngram_hashes(rows: np.ndarray, pad_id: int, multipliers: np.ndarray, max_ngram: int,
                 primes: np.ndarray, n_head: int, threads: int = 1) -> np.ndarray:
    """int64 ``[n_rows, T, (max_ngram-1)*n_head]`` hashes of int64 ids
    ``[n_rows, T]`` (the formula is in hashing.py)."""
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
            _ptr(out, "int64_t *"), threads) != 0:
        _raise("pthread_create", f"hashing with {threads} threads")
    return out


def hash_windows(ids: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                 commit: np.ndarray, hist: np.ndarray, next_pos: np.ndarray,
                 scratch: dict[str, np.ndarray], win: np.ndarray) -> tuple[int, int]:
    """The serving hash state's sequential pass (see native.c): raw windows
    into ``win [T, n]``, history updated in place on success.  Returns
    (-1, 0), or (index of the first bad token, 1 slot / 2 position)."""
    why = ffi.new("int64_t *")
    bad = lib.ne_hash_windows(
        _ptr(ids, "int64_t *"), _ptr(slots, "int64_t *"), _ptr(positions, "int64_t *"),
        _ptr(commit, "uint8_t *"), len(ids), hist.shape[0], hist.shape[1],
        _ptr(hist, "int64_t *"), _ptr(next_pos, "int64_t *"), _ptr(scratch["cur"], "int64_t *"),
        _ptr(scratch["cur_next"], "int64_t *"), _ptr(scratch["last"], "int64_t *"),
        _ptr(win, "int64_t *"), why)
    return int(bad), int(why[0])


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
