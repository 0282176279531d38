"""SharedEngramTable: one shard of one Engram layer in host memory, one
physical copy per sharing group.

``create`` turns its arguments into one ``CreateRequest`` and runs the
leader/peer protocol (``protocol``; docs/design.md, "Order of operations");
every collective is bounded by the request's timeout, and a failure
anywhere ends with the same clear exception in every member and nothing
left in /dev/shm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypedDict, overload

import numpy as np

from ..bindings import native
from ..errors import (
    LookupIdError,
    StorageError,
)
from ..histogram import LOOKUP_BUCKETS, Histogram
from ..host.topology import Topology, current_node
from ..literals import DEFAULT_DIRECTORY, CreateMode, IdFormat, PageSize, check_id_format
from ..lookup.cpu import (
    bad_id_text,
    default_lookup_threads,
    id_base,
    ids_for_kernel,
)
from ..lookup.outputs import (
    OutputPool,
    PreparedOutput,
    check_bf16_out,
    packed_out,
    prepare_out,
    scales_shape,
)
from ..model.family import TableFamily
from ..model.sharding import ShardInfo, prefix_offsets
from ..model.spec import EngramSpec
from ..store import serviceclient
from ..store.fileformat import STATE_READY
from ..store.placement import PlacementPlan, PlacementReport, verify
from ..store.storage import BackingFile
from . import protocol
from .checkpoint import Progress, TensorNames
from .group import SingleProcessGroup, as_group
from .membership import MemberInfo, identity_key
from .request import CREATE_MODES, CreateRequest, check_shard, shard_key, table_layout

if TYPE_CHECKING:
    import torch

    Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    from ..lookup.gpu import DeviceShard

log = logging.getLogger(__name__)
_INT64 = np.dtype(np.int64)  # numpy's one int64 descriptor: what arrays of int64 carry
_from_buffer = native.ffi.from_buffer
_ne_lookup, _NULL = native.lib.ne_lookup, native.ffi.NULL


@dataclass(frozen=True)
class TableStats:
    """What a serving stack exports about one table (``table.stats()``).
    Placement figures are those of the last ``placement_report()`` (a page
    walk of a 190 GiB table is ~50 M pages: never done per call)."""

    layer_id: int
    head_start: int
    head_end: int
    mode: str
    table_bytes: int
    lookups: int            # calls, CPU and GPU
    rows: int               # rows asked for (DEAD ones included)
    bytes_read: int         # rows x row bytes
    lookup_seconds: float   # CPU lookups' kernel time, counted by the kernel (GPU time:
                            # the scheduler's CUDA events)
    fraction_on_plan: float | None
    bytes_per_node: dict[int, int]
    # the memory this process accounts for: its own copy, or a shared copy
    # when it leads the group (so a sum over processes counts each copy
    # once); 0 for attached tables (their holder accounts for them)
    physical_bytes: int = 0
    bad_id_lookups: int = 0     # lookups refused for ids outside the shard's buckets
    failed_lookups: int = 0     # lookups that failed otherwise
    latency: tuple = ()         # CPU lookups' kernel times: Histogram.snapshot()


def accounted_bytes(mode: str, leader: bool, backing_bytes: int) -> int:
    """What a table's process accounts for (``TableStats.physical_bytes``):
    its own copy, or a shared copy when it leads the group, else 0."""
    return backing_bytes if mode == "independent" or mode == "dp_shared" and leader else 0


class PlacementSummary(TypedDict):
    policy: str
    planned_bytes_per_node: dict[int, int]
    fraction_on_plan: float | None
    pages_per_node: dict[int, int] | None


class ModeReport(TypedDict):
    """What ``mode_report()`` says a member really runs (JSON-ready)."""

    mode: str  # dp_shared | independent | attached | service
    requested_mode: str  # auto | dp_shared | independent | attach | service
    fallback_reason: str
    embedding_dp_size: int
    layer_id: int
    head_start: int
    head_end: int
    row_start: int
    row_end: int
    num_rows: int
    sharing_group: list[int]  # world ranks
    member_pids: list[int]
    leader: bool
    backing_path: str
    backing_bytes: int
    placement: PlacementSummary | None
    registered_device: int | None
    lookup_threads: int
    lookup_cpus: list[int]
    identity: dict[str, Any]
    startup_s: dict[str, float]  # this member's create (or attach) steps, in seconds
    startup_gib_per_s: dict[str, float]


class SharedEngramTable:
    """Use ``SharedEngramTable.create(...)``; then ``lookup``, ``weights``,
    ``scales``, ``placement_report()``, ``mode_report()``, ``close()``."""

    def __init__(self, spec: EngramSpec, layer_id: int, shard: ShardInfo, backing: BackingFile,
                 *, mode: str, requested_mode: str, members: list[MemberInfo], leader: bool,
                 plan: PlacementPlan | None, report: PlacementReport | None,
                 registration: Any = None, fallback_reason: str = "",
                 lookup_threads: int | None = None, lookup_cpus: tuple[int, ...] = (),
                 startup_phases: dict[str, float] | None = None) -> None:
        self.spec, self.layer_id, self.shard = spec, layer_id, shard
        # seconds of this member's create steps (checks, create, populate, map, register, load)
        self.startup_phases = dict(startup_phases or {})
        self._backing = backing
        self.mode, self.requested_mode = mode, requested_mode
        self.members, self.leader = members, leader
        self.plan, self._report = plan, report
        self.registration = registration
        self.fallback_reason = fallback_reason
        self.lookup_cpus = lookup_cpus
        self.lookup_threads = default_lookup_threads(lookup_cpus) if lookup_threads is None \
            else lookup_threads
        self.path = backing.path
        self.backing_bytes = backing.layout.file_size
        self.weights = backing.region("weights").reshape(shard.num_rows, spec.head_dim)
        self.scales = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)
        self._bucket_sizes = np.asarray(
            spec.bucket_sizes(layer_id)[shard.head_start:shard.head_end], dtype=np.int64)
        # the kernel's fixed arguments, cast once: a call adds only ids and output
        self._geometry: native.Geometry | None = native.Geometry.of(
            self.weights, self.scales, prefix_offsets(self._bucket_sizes), self._bucket_sizes,
            self.id_base("global"), spec.block)
        self._kernel: native.ShardKernel | None = None  # bound at the first lookup
        self._n_cols, self._row_shape = spec.n_hash_cols, (shard.num_heads, spec.head_dim)
        self._device_shard: DeviceShard | None = None
        self._closed = False
        # GPU lookups in flight (CPU ones: the kernel's count): close() waits
        # for them (they finish normally), on this condition
        self._active = 0
        self._idle = threading.Condition(threading.Lock())
        # lookup(ids) without out= reuses freed outputs (the pool's own lock)
        self._outputs = OutputPool()
        self._packed_pools = (OutputPool(packed=True), OutputPool(packed=True))  # rows, scales
        # the CPU lookups that ran are counted by the kernel (rows, time),
        # which refuses them once the table is closed; here, under the lock,
        # the GPU launches and their rows, and the lookups that failed, by why
        self._state = native.TableState(LOOKUP_BUCKETS)
        self._failures = {"bad_ids": 0, "failed": 0}
        self._gpu_lookups = self._gpu_rows = 0

    # ------------------------------------------------------------ create --
    @classmethod
    def create(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *, group: Any = None,
               placement: str | PlacementPlan | None = None,
               directory: str | None = DEFAULT_DIRECTORY, checkpoint: Any = None,
               register_device: int | None = None, timeout_s: float = 300.0,
               mode: CreateMode = "auto", topology: Topology | None = None,
               names: TensorNames | None = None, progress: Progress | None = None,
               lookup_threads: int | None = None, page_size: PageSize | int = "4K",
               load_threads: int | None = None, shared_load: bool | None = None,
               stall_timeout_s: float | None = None) -> SharedEngramTable:
        """Collective over ``group`` (its rank 0 leads; None: a private table).

        page_size: ``4K`` (shmem: /dev/shm or a memfd), ``2M`` or ``1G``
        (hugetlb: a hugetlbfs mount of that size, found in /proc/self/mounts
        when ``directory`` is left at its default, or an MFD_HUGETLB memfd;
        each planned node's pool must have the pages free).

        lookup_threads: at most this many threads per lookup (None: one per
        CPU of the rows' node this process may use, at most 4); a call splits
        only where each thread gets at least ``lib.NE_SPLIT_ROWS`` rows, so a
        decode step runs on the calling thread and a prefill chunk on the
        table's persistent threads as well.

        load_threads: threads per loader that pre-fault the table and copy
        the checkpoint, pinned to the CPUs of the node the rows are bound to
        (None: one per CPU this process may use, at most 8).  shared_load:
        the members on the rows' node each load a part (the default; False:
        the leader loads everything).  stall_timeout_s: how long the load
        may make no progress before every member fails (None: timeout_s).

        mode: ``dp_shared`` (one copy for the group; fails loudly when it
        cannot share), ``independent`` (each member its own copy) or ``auto``
        (shares when the group has > 1 member, its members can map one file
        and the tmpfs has room, else falls back to independent copies, when
        those fit in memory, with a warning).  Every member must pass the
        same layer, shard and mode.  Every collective is bounded by
        ``timeout_s``; a load waits as long as some loader makes progress
        (at most ``stall_timeout_s`` without any).
        Every member ends the same way: all return a table, or all raise the
        same class (our own, or MemberFailure) naming every failing member."""
        req = CreateRequest.of(spec, layer_id, shard, mode=mode, placement=placement,
                               directory=directory, page_size=page_size, checkpoint=checkpoint,
                               names=names, register_device=register_device,
                               timeout_s=timeout_s, topology=topology, progress=progress,
                               lookup_threads=lookup_threads, load_threads=load_threads,
                               shared_load=shared_load, stall_timeout_s=stall_timeout_s)
        grp = SingleProcessGroup() if group is None else as_group(group)
        with grp.bounded(req.timeout_s):
            built = protocol.create(grp, req)
        table = cls(spec, layer_id, shard, built.backing, mode=built.mode, requested_mode=mode,
                    members=built.members, leader=built.leader, plan=built.plan,
                    report=built.report, registration=built.registration,
                    fallback_reason=built.fallback_reason, lookup_threads=req.lookup_threads,
                    lookup_cpus=built.lookup_cpus, startup_phases=built.phases)
        log.info("Engram table: %s", table.mode_report())
        return table

    @classmethod
    def attach(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *,
               path: str | None = None, fd: int | None = None, service: str | None = None,
               node: int | None = None, page_size: PageSize | int = "4K",
               register_device: int | None = None, timeout_s: float = 10.0,
               service_uids: Sequence[int] | None = None,
               allow_unsealed: bool | None = None) -> SharedEngramTable:
        """Map a READY table handed over outside a group, read-only, after
        the same checks a peer makes (spec, size, layer and shard): by its
        ``path`` (before the unlink), an ``fd`` passed over a Unix socket,
        or from the table service listening on ``service`` (its socket
        path: ``numa-engram serve``), which hands over the descriptor of
        this spec, layer, shard and ``page_size`` (its copy on ``node``,
        default the node this thread runs on, when it holds one per node).
        ``register_device``: pin the mapping for zero-copy reads by that GPU.
        No per-byte work but the registration: O(1) in the table's size.
        A service is believed only when it runs as our uid, root or one of
        ``service_uids``, and its descriptor only when sealed against
        writes, growth and shrinking unless ``allow_unsealed`` (defaults:
        ``NUMA_ENGRAM_SERVICE_UIDS``, ``NUMA_ENGRAM_ALLOW_UNSEALED``)."""
        check_shard(spec, layer_id, shard)
        if sum(x is not None for x in (path, fd, service)) != 1:
            raise ValueError("give exactly one of path=, fd= or service=")
        started = time.perf_counter()
        here = current_node(Topology.detect())  # read once: the service's copy and our record
        received, owner_uid, mode = None, None, "attached"
        if service is not None:
            trust = serviceclient.ServiceTrust.of(service_uids, allow_unsealed)
            received, owner_uid = service_descriptor(spec, layer_id, shard, service,
                                                     here if node is None else node, page_size,
                                                     timeout_s, trust)
            fd, mode = received, "service"
        try:
            backing = BackingFile.attach(path, fd=fd, fingerprint=spec.fingerprint,
                                         key=shard_key(layer_id, shard), owner_uid=owner_uid,
                                         layout_for=lambda page: table_layout(spec, shard, page))
        finally:
            if received is not None:
                os.close(received)  # the backing holds its own duplicate
        registration = None
        try:
            if backing.state != STATE_READY:
                raise StorageError(f"table {backing.path} is not READY (its creator has not "
                                   "finished loading it); attach after create() returned")
            phases = {"attach": time.perf_counter() - started}
            if register_device is not None:
                mark = time.perf_counter()
                registration = protocol.register(backing, register_device)
                phases["register"] = time.perf_counter() - mark
            me = MemberInfo(0, os.getpid(), os.geteuid(), here, None,
                            spec.fingerprint, shard_key(layer_id, shard), "attach")
            table = cls(spec, layer_id, shard, backing, mode=mode,
                        requested_mode="service" if service is not None else "attach",
                        members=[me], leader=False, plan=None, report=None,
                        registration=registration, startup_phases=phases)
            log.info("Engram table attached: layer %d heads [%d, %d) from %s in %s", layer_id,
                     shard.head_start, shard.head_end, service or path or f"fd {fd}",
                     ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
            return table
        except BaseException:
            if registration is not None:
                registration.release()
            backing.close()  # a failed attach keeps no descriptor
            raise

    def dup_descriptor(self) -> int:
        """A new descriptor of the table's file (the caller closes it): what
        the table service keeps and hands over."""
        self._check_open()
        return os.dup(self._backing.fd)

    # ------------------------------------------------------------ lookup --
    @overload
    def lookup(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
               packed: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def lookup(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
               packed: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def lookup(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
               packed: bool = False) -> Rows:
        """BF16 ``[T, heads_in_shard, head_dim]`` rows for ``hash_ids
        [T, n_hash_cols]`` (int64 or int32; rows may be strided, e.g.
        ``out[:, i]`` of ``HashState.hash``); DEAD_ID (-1) gives zero rows.
        ``id_format="global"``: ids are rows of the layer's whole table, as
        V4.1's model code and vLLM pass them; each column of this shard must
        be -1 or inside its head's global rows.  ``packed=True``: the
        rows as stored, ``(weights uint8 [T, heads, head_dim], scales uint8
        [T, heads, head_dim/block])`` (half the output bytes; for a GPU
        that dequantises after the copy; ``out`` a pair of such tensors), as
        ``lookup_cuda(packed=True)`` gives them.  ``out`` may also be what
        ``prepare_out(buffer)`` gave, for a buffer used call after call."""
        if out is None and not packed and id_format == "bucket":
            # the default, a decode step's call: its Python is most of its
            # cost (the decode budget, docs/design.md), so the fewest steps: a decode
            # step's ids into the pooled output by the bound kernel, called
            # here as _run_kernel would; other ids, or a kernel not bound
            # yet, take the general path below
            kernel, address = self._kernel, self._decode_ids(hash_ids)
            if kernel is not None and address is not None and (bound := kernel.bound) is not None:
                tokens = hash_ids.shape[0]
                try:
                    result, _, buffer = self._outputs.take_with_buffer((tokens, *self._row_shape))
                    bad = _ne_lookup(bound, address, tokens, self._n_cols, False, buffer, _NULL)
                except BaseException:
                    self._count_failure("failed")
                    raise
                if bad:
                    self._kernel_failed(kernel, bad, tokens, False)
                return result
        check_id_format(id_format)
        ids, address, stride, tokens = self._kernel_ids(hash_ids)
        shape = (tokens, *self._row_shape)
        rows_out: Any  # (the BF16 tensor, or the packed pair)
        try:
            if isinstance(out, PreparedOutput):
                rows_out, bits, buffer = _prepared(out, shape, packed)
            elif out is None and not packed:  # (global ids: the pooled output too)
                rows_out, bits, buffer = self._outputs.take_with_buffer(shape)
            elif packed:
                rows_out, bits = self._packed_outputs(shape) if out is None else \
                    packed_out(out, shape, self.spec.block)
                buffer = None
            else:  # a caller's tensor: its address, not a numpy view (~3 us a call)
                check_bf16_out(out, shape)
                rows_out, bits, buffer = out, None, native.ffi.cast("uint16_t *", out.data_ptr())
            rows, scales = native.kernel_outputs(bits, buffer)
        except BaseException:
            self._count_failure("failed")
            raise
        self._run_kernel(address, shape[0], stride, id_format == "global", rows, scales)
        return rows_out

    def bind_lookup(self, out: Any, *, packed: bool = False,
                    id_format: IdFormat = "bucket") -> Callable[[Any], Rows]:
        """``lookup(ids, out=out, packed=packed, id_format=id_format)`` with
        everything but the ids bound once: ``out`` (``out.shape[0]``
        tokens) checked and cast here, so a call checks only the ids and runs
        the kernel (a staging buffer filled step after step: the prefetch
        scheduler's).  Calls return what ``lookup`` returns, raise what it
        raises and are counted alike."""
        check_id_format(id_format)
        prepared = out if isinstance(out, PreparedOutput) else self.prepare_out(out, packed=packed)
        result, bits, buffer = _prepared(prepared, prepared.shape, packed)  # (packed checked)
        rows, scales = native.kernel_outputs(bits, buffer)
        tokens, n_cols = prepared.shape[0], self._n_cols
        decode_shape = (tokens, n_cols)
        global_ids = id_format == "global"

        def lookup_into(hash_ids: Any) -> Rows:
            # a decode step's ids (as _decode_ids takes them) into the bound
            # kernel (as _run_kernel calls it) in this one frame (the decode
            # budget, docs/design.md)
            kernel = self._kernel
            if kernel is not None and (bound := kernel.bound) is not None and \
                    type(hash_ids) is np.ndarray and hash_ids.dtype is _INT64 and \
                    hash_ids.shape == decode_shape:
                try:
                    address = _from_buffer(hash_ids)
                except ValueError:  # strided: below
                    address = None
                if address is not None:
                    try:
                        bad = _ne_lookup(bound, address, tokens, n_cols, global_ids, rows,
                                         scales)
                    except BaseException:
                        self._count_failure("failed")
                        raise
                    if bad:
                        self._kernel_failed(kernel, bad, tokens, global_ids)
                    return result
            ids, address, stride, given = self._kernel_ids(hash_ids)  # (kept while read)
            if given != tokens:
                self._count_failure("failed")
                raise ValueError(f"{given} tokens of ids for a lookup bound to an "
                                 f"output of {tokens}; bind one for this many tokens")
            self._run_kernel(address, tokens, stride, global_ids, rows, scales)
            return result
        return lookup_into

    def _decode_ids(self, hash_ids: Any) -> Any:
        """The kernel's buffer of a decode step's ids: a C-contiguous int64
        ``[T, n_cols]`` array, their row stride ``n_cols``; None for any
        other ids (``_kernel_ids`` checks them).  cffi refuses a strided
        array, which gives None too."""
        if type(hash_ids) is np.ndarray and hash_ids.dtype is _INT64:
            shape = hash_ids.shape
            if len(shape) == 2 and shape[1] == self._n_cols:
                try:
                    return _from_buffer(hash_ids)
                except ValueError:
                    pass
        return None

    def _kernel_ids(self, hash_ids: Any) -> tuple[np.ndarray, Any, int, int]:
        """``ids_for_kernel`` for this table; a refusal is counted."""
        try:
            return ids_for_kernel(hash_ids, self._n_cols)
        except Exception as exc:
            self._count_refused(exc)
            raise

    def _count_refused(self, exc: Exception) -> None:
        """Ids refused before the kernel (``exc``), counted; a closed table
        raises StorageError instead."""
        self._enter_lookup()
        self._leave_lookup(-1, "bad_ids" if isinstance(exc, LookupIdError) else "failed")

    def _run_kernel(self, address: Any, tokens: int, stride: int, global_ids: bool, rows: Any,
                    scales: Any = native.ffi.NULL) -> None:
        """The shard's kernel over ids and outputs already cast
        (``_kernel_ids``, ``native.kernel_outputs``); bad ids raise
        LookupIdError, a closed table StorageError; failures are counted
        (the kernel counts the lookups, with their time)."""
        try:
            kernel = self._kernel or self._shard_kernel()  # (made at the first lookup)
            bad = kernel.run(address, tokens, stride, global_ids, rows, scales)
        except StorageError:  # closed: not a lookup
            raise
        except BaseException:
            self._count_failure("failed")
            raise
        if bad:
            self._kernel_failed(kernel, bad, tokens, global_ids)

    def _kernel_failed(self, kernel: native.ShardKernel, bad: int, tokens: int,
                       global_ids: bool) -> NoReturn:
        """The kernel's call of ``tokens`` tokens returned ``bad`` (not 0):
        LookupIdError for bad ids, StorageError once closed, else why it
        failed; counted."""
        try:
            count, first, value = kernel.bad_ids(bad, tokens)
            self._raise_bad_ids(count, first, value, global_ids)
        except LookupIdError:
            self._count_failure("bad_ids")
            raise
        except StorageError:  # closed: not a lookup
            raise
        except BaseException:
            self._count_failure("failed")
            raise

    def _packed_outputs(self, shape: tuple[int, ...]) -> tuple[Any, Any]:
        """Pooled (rows, scales) uint8 tensors for a packed lookup, and their
        numpy views."""
        rows, rows_bits, _ = self._packed_pools[0].take_with_buffer(shape)
        scales, scales_bits, _ = self._packed_pools[1].take_with_buffer(
            scales_shape(shape, self.spec.block))
        return (rows, scales), (rows_bits, scales_bits)

    def prepare_out(self, out: Any, *, packed: bool = False) -> PreparedOutput:
        """``out`` (what ``lookup(ids, out=out, packed=packed)`` takes, for
        ``out.shape[0]`` tokens) checked and cast once: pass the result as
        ``out=`` to every lookup of that many tokens into it (a staging
        buffer), and the per-call checks are skipped."""
        rows = out[0] if packed and isinstance(out, tuple) and out else out
        if not hasattr(rows, "shape") or len(rows.shape) == 0:
            raise ValueError("out must be " + ("a (rows, scales) pair of uint8 CPU tensors"
                                               if packed else "a CPU bfloat16 tensor") +
                             f" [tokens, {', '.join(map(str, self._row_shape))}], got "
                             f"{type(out).__name__}")
        return prepare_out(out, (int(rows.shape[0]), *self._row_shape), packed, self.spec.block)

    def _raise_bad_ids(self, count: int, first: int, value: int, global_ids: bool) -> NoReturn:
        """LookupIdError for the kernel's first bad id (flat index ``first``)."""
        t, h = divmod(first, self.shard.num_heads)
        base = self.id_base("global") if global_ids else None
        raise LookupIdError(bad_id_text(value, t, self.shard.head_start + h,
                                         int(self._bucket_sizes[h]), base, h, count))

    @property
    def lookup_cpus(self) -> tuple[int, ...]:
        return self._lookup_cpus

    @lookup_cpus.setter
    def lookup_cpus(self, cpus: Sequence[int]) -> None:
        self._lookup_cpus = tuple(cpus)
        self._drop_kernel()  # its threads are pinned to the old CPUs

    @property
    def lookup_threads(self) -> int:
        return self._lookup_threads

    @lookup_threads.setter
    def lookup_threads(self, threads: int) -> None:
        self._lookup_threads = max(1, int(threads))
        self._drop_kernel()

    def _shard_kernel(self) -> native.ShardKernel:
        """This table's kernel, bound to its threads and CPUs (made at the
        first lookup; its workers stop with close())."""
        kernel = self._kernel  # made once: the lock only to make it
        if kernel is not None:
            return kernel
        with self._idle:
            self._check_open()
            if self._kernel is None:
                assert self._geometry is not None  # (None only once closed)
                self._kernel = native.ShardKernel(self._geometry, self._lookup_threads,
                                                  self._lookup_cpus, self.shard.head_start,
                                                  state=self._state)
            return self._kernel

    def _drop_kernel(self, stop: bool = False) -> None:
        """Forget this table's kernel; the next lookup binds anew.  Its
        threads stop when the last lookup still using it lets go of it (a
        setter may run while other threads look up: stopping them under a
        running call freed its pool), or at once with ``stop`` (close(),
        when no lookup runs)."""
        kernel = getattr(self, "_kernel", None)
        self._kernel = None
        if kernel is not None and stop:
            kernel.close()

    def id_base(self, id_format: IdFormat) -> np.ndarray | None:
        """Each shard head's first global row (None for bucket ids)."""
        return id_base(self.spec, self.layer_id, self.shard.head_start, self.shard.head_end,
                       id_format)

    def device_view(self) -> DeviceShard:
        """Zero-copy CUDA views of this shard (needs register_device=)."""
        from ..lookup.gpu import DeviceShard

        self._check_open()
        if self.registration is None:
            raise StorageError("the table is not registered with CUDA; create it with "
                               "register_device=<cuda device index>")
        if self._device_shard is None:
            self._device_shard = DeviceShard(self.weights, self.scales, self.registration.device,
                                             self.shard.head_start, self._bucket_sizes,
                                             self.spec.block, self.registration,
                                             self.id_base("global"))
        return self._device_shard

    def lookup_cuda(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
                    packed: bool = False, max_sms: int | None = None,
                    background: bool = False) -> Rows:
        """The lookup on the GPU that registered the table: one fused kernel
        reading rows over PCIe (zero-copy) and dequantising on the device;
        ids must already be on that GPU; no host sync (bad ids: zero rows,
        raised by ``check_device_errors()``).  See ``DeviceShard.lookup``."""
        self._enter_lookup()
        rows = -1  # -1: failed, not counted
        try:
            result = self.device_view().lookup(hash_ids, out=out, id_format=id_format,
                                               packed=packed, max_sms=max_sms,
                                               background=background)
            rows = hash_ids.shape[0] * self.shard.num_heads
            return result
        finally:
            self._leave_lookup(rows)

    def check_device_errors(self) -> None:
        """Raise LookupIdError for bad ids the GPU lookups met since the last
        check (reads the device record: one sync), and clear it."""
        if self._device_shard is not None:
            self._device_shard.check_errors()

    # ----------------------------------------------------------- reports --
    def placement_report(self, refresh: bool = True) -> PlacementReport | None:
        """Where this member sees the pages (re-measured unless refresh=False)."""
        self._check_open()
        if self.plan is None:
            return None
        if refresh or self._report is None:
            self._report = verify(self._backing.mapping, self.plan)
        return self._report

    def stats(self) -> TableStats:
        """Counters since creation and the last placement report's figures."""
        report = self._report
        with self._idle:
            failures, gpu_lookups, gpu_rows = dict(self._failures), self._gpu_lookups, \
                self._gpu_rows
        lookups, rows, seconds, buckets = self._state.counts()
        latency = Histogram.of(buckets, seconds).snapshot()  # CPU lookups: GPU ones are launches
        lookups, rows = lookups + gpu_lookups, rows + gpu_rows
        physical = accounted_bytes(self.mode, self.leader, self.backing_bytes)
        return TableStats(self.layer_id, self.shard.head_start, self.shard.head_end, self.mode,
                          self.backing_bytes, lookups, rows,
                          rows * self.spec.row_bytes, seconds,
                          None if report is None else report.fraction_on_plan,
                          report.bytes_per_node() if report is not None else {},
                          physical, failures["bad_ids"], failures["failed"], latency)

    def mode_report(self) -> ModeReport:
        report = self._report
        return {
            "mode": self.mode, "requested_mode": self.requested_mode,
            "fallback_reason": self.fallback_reason, "embedding_dp_size": 1,
            "layer_id": self.layer_id, "head_start": self.shard.head_start,
            "head_end": self.shard.head_end, "row_start": self.shard.row_start,
            "row_end": self.shard.row_end, "num_rows": self.shard.num_rows,
            "sharing_group": [m.rank for m in self.members],
            "member_pids": [m.pid for m in self.members], "leader": self.leader,
            "backing_path": self.path, "backing_bytes": self.backing_bytes,
            "placement": None if self.plan is None else {
                "policy": self.plan.policy, "planned_bytes_per_node": self.plan.bytes_per_node(),
                "fraction_on_plan": None if report is None else report.fraction_on_plan,
                "pages_per_node": None if report is None else report.pages_per_node()},
            "registered_device": None if self.registration is None else
            self.registration.device,
            "lookup_threads": self.lookup_threads, "lookup_cpus": list(self.lookup_cpus),
            "identity": identity_key(self.members[0]),
            "startup_s": {k: round(v, 6) for k, v in self.startup_phases.items()},
            # the table's bytes over each phase's seconds (attach: the size it made usable)
            "startup_gib_per_s": {k: round(self.backing_bytes / v / 2**30, 3)
                                  for k, v in self.startup_phases.items() if v > 0},
        }

    # ------------------------------------------------------------- close --
    def close(self) -> None:
        """Unregister, unmap (idempotent).  Waits for lookups already
        running (they finish normally); a lookup after close() raises
        StorageError.  Views handed out stay valid until they are dropped."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._active == 0)  # GPU lookups
        self._state.close()  # CPU lookups: later ones refused, running ones finish
        self._drop_kernel(stop=True)  # no lookup runs now: the threads stop here
        # no view of the mapping may outlive close: empty arrays of the same
        # row shape stand in for the rows
        self.weights = np.empty((0, self.weights.shape[1]), np.uint8)
        self.scales = np.empty((0, self.scales.shape[1]), np.uint8)
        self._device_shard = self._geometry = None
        # device views still alive keep the registration (and the memory)
        # until they are dropped; without any, this unregisters now
        self.registration = None
        self._backing.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the table is closed")

    def _enter_lookup(self) -> None:
        """A GPU lookup (or a failed CPU one, to be counted) begins: refused
        once closed; close() waits until it ends.  (CPU lookups that run are
        counted, and refused once closed, by the kernel.)"""
        with self._idle:
            self._check_open()
            self._active += 1

    def _leave_lookup(self, rows: int, failure: str = "failed") -> None:
        """A lookup from ``_enter_lookup`` ended: a GPU launch of ``rows``
        rows, or (rows -1) one that failed, counted as ``failure``; wakes a
        waiting close()."""
        with self._idle:
            self._active -= 1
            if rows < 0:
                self._failures[failure] += 1
            else:
                self._gpu_lookups += 1
                self._gpu_rows += rows
            if self._closed:
                self._idle.notify_all()

    def _count_failure(self, failure: str) -> None:
        """A CPU lookup that reached the kernel failed (bad ids, an error)."""
        with self._idle:
            self._failures[failure] += 1

    def __enter__(self) -> SharedEngramTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prepared(out: PreparedOutput, shape: tuple[int, ...], packed: bool) -> tuple[Any, Any, Any]:
    """A prepared output's (result, bits, buffer), if it fits the call."""
    if out.shape != shape or out.packed != packed:
        raise ValueError(f"a prepared output of shape {list(out.shape)} (packed={out.packed}) "
                         f"for a lookup of shape {list(shape)} (packed={packed}); prepare one "
                         "for this many tokens")
    return out.result, out.bits, out.buffer


__all__ = ["CREATE_MODES", "ModeReport", "SharedEngramTable", "TableStats", "table_layout"]


def service_descriptor(spec: TableFamily, layer_id: int, shard: ShardInfo, service: str,
                       node: int, page_size: PageSize | int, timeout_s: float,
                       trust: serviceclient.ServiceTrust) -> tuple[int, int]:
    """(the descriptor the table service on ``service`` hands over for this
    table's shard and ``page_size``, its copy on ``node``; the service's uid)."""
    from ..host.hugepages import parse_page_size

    request = serviceclient.TableRequest(spec.fingerprint, shard_key(layer_id, shard),
                                         parse_page_size(page_size), node)
    fd, _, uid = serviceclient.fetch(service, request, timeout_s, trust)
    return fd, uid
