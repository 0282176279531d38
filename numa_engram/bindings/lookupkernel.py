"""Typed Python over the C core's lookup kernels: ids and outputs as the
kernel takes them, the persistent worker pools, a shard's geometry and
tuning, ``ShardKernel`` (a table's lookup bound once), ``PLEShard`` and
``StepKernel`` (a step's layers in one call).
No torch here."""

from __future__ import annotations

import errno
import functools
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import SpecError, StorageError, SyscallError
from . import native
from .native import ffi, lib, ptr, raise_errno


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


def first_bad_id(ids: np.ndarray, col0: int, sizes: np.ndarray,
                 id_base: np.ndarray | None) -> int:
    """Flat (token * heads + head) index of the first id of columns
    ``col0 ..`` that is neither -1 nor inside its head's range; -1 if none."""
    if ids.shape[0] == 0:
        return -1
    address, stride = ids_args(ids)
    return int(lib.ne_first_bad_id(ffi.cast("int64_t *", address) + col0, ids.shape[0], stride,
                                   len(sizes), ptr(sizes, "int64_t *"),
                                   ffi.NULL if id_base is None else ptr(id_base, "int64_t *")))


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


def this_pid() -> int:
    """This process's pid without a system call (renewed in a forked child):
    what a binding made in a parent compares, to bind again in the child."""
    return _this_process[0]


class Workers:
    """Lookup threads kept alive between calls (``ne_pool``), each bound to
    the CPUs ``cpus`` (the rows' node: the kernel puts each on an idle one);
    a call's caller runs one part itself, so ``threads`` workers serve calls
    of ``threads + 1``.  Stopped by ``close()`` or when dropped.  A forked
    child's copy has no threads: ``usable`` is False there (the
    owner makes a new pool), and dropping it only frees the memory."""

    def __init__(self, threads: int, cpus: Sequence[int] = ()) -> None:
        cpu_arr = np.asarray(list(cpus), dtype=np.int32)
        pool = lib.ne_pool_new(threads, ptr(cpu_arr, "int *") if len(cpu_arr) else ffi.NULL,
                               len(cpu_arr))
        if pool == ffi.NULL:
            raise_errno("pthread_create", f"a pool of {threads} lookup threads")
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
            "weights": ptr(weights, "uint8_t *"), "scales": ptr(scales, "uint8_t *"),
            "dim": weights.shape[1], "block": block, "n_heads": len(counts),
            "head_offsets": ptr(offs, "int64_t *"), "bucket_sizes": ptr(counts, "int64_t *"),
            "id_base": ffi.NULL if base is None else ptr(base, "int64_t *")})
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
        """The ``struct ne_tuning *`` of these values; SpecError naming the
        value and the bounds when one is not an integer or is outside them."""
        made = ffi.new("struct ne_tuning *")
        for name, value in vars(self).items():
            fits = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
            try:
                if fits:
                    setattr(made, name, int(value))
            except OverflowError:  # wider than its C field
                fits = False
            if not fits:
                raise SpecError(f"tuning {name}={value!r} is not an integer in range: "
                                f"{self.bounds()}")
        if lib.ne_tuning_check(made) != 0:
            raise SpecError(f"tuning {self}: {self.bounds()}")
        return made

    @staticmethod
    def bounds() -> str:
        """What each field may be (``ne_tuning_check``'s rule)."""
        return (f"small_rows must be in 0..{lib.NE_MAX_SMALL_ROWS}, split_rows >= 1, "
                f"job_rows in 1..{lib.NE_SHARE_ROWS}, stream_bytes >= 0, prefetch_ahead in "
                f"0..{lib.NE_MAX_PREFETCH_AHEAD}, prefetch_hint in 0..3")


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
    kernel = ShardKernel(geom, threads, col0=col0, persistent=False, tuning=tuning,
                         ids_cols=ids.shape[1])
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
    threads; ``persistent=False``: fresh threads per call instead), the
    table's ``TableState`` (``state``: its lookups counted, refused once it
    is closed) and the bytes of the table's mapping (``mapped``), which the
    kernel refuses an output over (NE_OVERLAP), as one over the ids'
    whole tokens (``ids_cols`` columns each; 0: the shard's own).
    ``bound`` is that struct once a call (or ``bind()``) made it in this
    process: None before, after ``close()`` and in a forked child.  Every
    lookup goes through ``run`` (``ShardRows`` calls it with ids and
    outputs already cast).  After ``close()`` a call raises StorageError."""

    def __init__(self, geometry: Geometry, threads: int, cpus: Sequence[int] = (),
                 col0: int = 0, *, persistent: bool = True,
                 state: TableState | None = None, tuning: Tuning | None = None,
                 mapped: tuple[int, int] = (0, 0), ids_cols: int = 0) -> None:
        self.geometry, self.threads, self.cpus = geometry, max(1, int(threads)), tuple(cpus)
        self.col0, self.persistent, self.state = int(col0), persistent, state
        # the table's mapping and the ids' whole tokens (ids_cols columns
        # each): the kernel refuses an output over either
        self.mapped, self.ids_cols = mapped, int(ids_cols)
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
        call failed (-1: no thread or no scratch; -2: the table is closed;
        NE_OVERLAP: an output over the ids or the table, which a caller
        that knows the buffers names first)."""
        if bad == -2:
            raise StorageError("the table is closed")
        if bad == NE_OVERLAP:
            raise SpecError(OVERLAP_TEXT)
        if bad == native.NE_FAULTED:
            raise native.fault_error("an Engram lookup")
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
                    "tuning": self._tuning, "map_lo": self.mapped[0],
                    "map_hi": self.mapped[1], "ids_cols": self.ids_cols})
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
NE_OVERLAP: int = lib.NE_OVERLAP  # either kernel's: an output over the ids or the table
OVERLAP_TEXT = ("a lookup's output shares bytes with the ids it reads or the table's mapping; "
                "pass a buffer of its own (e.g. torch.empty)")


def _check_lookup_rc(rc: int, tokens: int, heads: int, threads: int) -> None:
    if rc != 0 and ffi.errno == errno.ENOMEM:
        raise MemoryError(f"lookup of {tokens} tokens x {heads} heads: no memory "
                          "for its scratch (up to 8 MiB per thread); free memory or pass "
                          "fewer tokens")
    if rc != 0:
        raise_errno("pthread_create", f"lookup with {threads} threads")


class PLEShard:
    """One PLE shard's fixed lookup arguments cast once (``struct
    ne_ple_shard``): a uint8 ``table [rows, row_bytes]`` holding rows
    ``row_start ..`` of a layer of ``total_rows``, the per-tensor ``scale``
    (a BF16 value: vLLM's ``rows.to(bf16) * scale.to(bf16)``; None: BF16
    rows), ``workers`` a large call is split over (with the caller), the
    table's ``TableState`` (``state``: lookups counted by the kernel,
    refused once it is closed; None: neither) and the bytes of the table's
    mapping (``mapped``), which the kernel refuses an output over.  Keeps
    the table, workers and state alive while it is."""

    def __init__(self, table: np.ndarray, row_start: int, total_rows: int,
                 scale: float | None, workers: Workers | None = None,
                 state: TableState | None = None, mapped: tuple[int, int] = (0, 0)) -> None:
        self.table, self.workers, self.state = table, workers, state
        self.struct = ffi.new("struct ne_ple_shard *", {
            "table": ptr(table, "uint8_t *") if table.size else ffi.NULL,
            "n_rows": table.shape[0], "row_bytes": table.shape[1], "row_start": row_start,
            "total_rows": total_rows, "scale": 0.0 if scale is None else scale,
            "pool": workers.pool if workers is not None and workers.usable else ffi.NULL,
            "state": ffi.NULL if state is None else state.struct,
            "map_lo": mapped[0], "map_hi": mapped[1]})
        lib.ne_ple_shard_init(self.struct)  # the scale's table of the 256 FP8 bytes
        # kernel(ids, n_ids, scaled, out): ``ne_ple_lookup`` on this shard
        # (ids: C-contiguous int64 cast by ``ffi.from_buffer``, at least
        # one; out: BF16 bits of byte x scale (scaled) or the stored bytes,
        # zeros for ids outside the shard); its result: -1, the position of
        # the first id outside the layer, or a failure (``ple_failed``).
        # The one place Python calls it.
        self.kernel = functools.partial(lib.ne_ple_lookup, self.struct)


PLE_CLOSED = -4  # ne_ple_lookup's: the shard's TableState was closed, nothing read


def ple_failed(code: int) -> NoReturn:
    """The error of ``ne_ple_lookup``'s failure ``code`` (below -1)."""
    if code == PLE_CLOSED:
        raise StorageError("the table is closed")
    if code == native.NE_FAULTED:
        raise native.fault_error("a PLE lookup")
    if code == NE_OVERLAP:
        raise SpecError(OVERLAP_TEXT)
    raise SyscallError("ne_ple_lookup", ffi.errno, "a row of no bytes")


class StepKernel:
    """A decode step's gathers for ``n`` layers in one C call
    (``ne_gather_step``, the GIL released once): each layer is filled once
    (``set_engram``, ``set_ple``: its bound kernel or shard and its
    output), then a call writes only the layers' ids (``ids``, and an
    Engram layer's row stride in ``strides``) and runs.  Keeps what the
    structs point into alive."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.layers = ffi.new("struct ne_gather[]", max(n, 1))
        self.ids = ffi.new("void *[]", max(n, 1))
        self.strides = ffi.new("int64_t[]", max(n, 1))
        self._keep: list[Any] = [None] * n

    def set_engram(self, i: int, kernel: ShardKernel, tokens: int, global_ids: bool,
                   rows: Any, scales: Any = ffi.NULL) -> None:
        """Layer ``i``: an Engram shard's kernel (bound in this process
        here) into ``rows`` (BF16 bits, or packed rows with ``scales``)."""
        bound = kernel.bind()
        layer = self.layers[i]
        layer.engram, layer.ple, layer.global_ids, layer.scaled = bound, ffi.NULL, global_ids, 0
        layer.tokens, layer.out, layer.out_scales = tokens, rows, scales
        self._keep[i] = (kernel, bound, rows, scales)

    def set_ple(self, i: int, shard: PLEShard, n_ids: int, scaled: bool, out: Any) -> None:
        """Layer ``i``: a PLE shard's ``n_ids`` ids into ``out``."""
        layer = self.layers[i]
        layer.engram, layer.ple, layer.global_ids, layer.scaled = ffi.NULL, shard.struct, 0, scaled
        layer.tokens, layer.out, layer.out_scales = n_ids, out, ffi.NULL
        self._keep[i] = (shard, out)

    def run(self) -> int:
        """Every layer gathered from the ids written into ``ids`` (and
        ``strides``): -1, or the index of the layer that failed
        (``failure`` says how; the layers before it have their rows)."""
        return lib.ne_gather_step(self.layers, self.n, self.ids, self.strides)

    @staticmethod
    def failure() -> tuple[int, int]:
        """(the failed layer's kernel code, the layer whose ids its output
        met, or -1) of this thread's last failed ``run``."""
        got = ffi.new("int64_t[2]")
        lib.ne_step_failure(got)
        return int(got[0]), int(got[1])
