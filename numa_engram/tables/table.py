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
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from ..checkpoints.checkpoint import Progress, TensorNames
from ..errors import (
    StorageError,
)
from ..groups.group import SingleProcessGroup, as_group
from ..histogram import Histogram
from ..host.hugepages import parse_page_size
from ..host.topology import Topology, current_node
from ..literals import DEFAULT_DIRECTORY, CreateMode, IdFormat, PageSize
from ..lookup.outputs import PreparedOutput
from ..lookup.shardrows import ShardRows
from ..model.sharding import ShardInfo
from ..model.spec import EngramSpec
from ..store import fdhandover, serviceclient
from ..store.placement import PlacementPlan, PlacementReport, verify
from . import mappedtier, protocol
from .mappedtier import check_tier
from .membership import identity_key
from .protocol import Built
from .request import (
    CREATE_MODES,
    CreateRequest,
    TableOptions,
    check_shard,
    positive_seconds,
    table_layout,
)
from .tablereports import ModeReport, TableStats, accounted_bytes, service_descriptor

if TYPE_CHECKING:
    import torch

    from ..lookup.gpu import DeviceShard
    from ..lookup.shardrows import Rows

log = logging.getLogger(__name__)


class SharedEngramTable:
    """Use ``SharedEngramTable.create(...)``; then ``lookup``, ``weights``,
    ``scales``, ``placement_report()``, ``mode_report()``, ``close()``."""

    def __init__(self, spec: EngramSpec, layer_id: int, shard: ShardInfo, built: Built, *,
                 requested_mode: str, lookup_threads: int | None = None) -> None:
        """A table from what the protocol (or an attach) made: ``built``."""
        self.spec, self.layer_id, self.shard = spec, layer_id, shard
        backing = built.backing
        # seconds of this member's create steps (checks, create, populate, map, register, load)
        self.startup_phases = dict(built.phases)
        self._backing = backing
        self.mode, self.requested_mode = built.mode, requested_mode
        # "resident" (a table file) or "mapped" (the checkpoint's pages: mappedtier)
        self.tier: str = getattr(backing, "tier", "resident")
        self.members, self.leader = built.members, built.leader
        self.plan, self._report = built.plan, built.report
        self.registration = registration = built.registration
        self.fallback_reason = built.fallback_reason
        lookup_cpus = built.lookup_cpus
        self.path = backing.path
        # where a process that was not in the create attaches (peers=): the
        # hand-over directory of a 4 KiB dp_shared table, else None
        self.handover = backing.handover_directory
        self.backing_bytes = backing.layout.file_size
        self.weights = backing.region("weights").reshape(shard.num_rows, spec.head_dim)
        self.scales = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)
        # the lookups (CPU and GPU), their kernel, outputs and counters
        mapping = backing.mapping  # no out= may share its bytes (a read-only one: a SIGSEGV)
        self.rows = ShardRows(spec, layer_id, shard, self.weights, self.scales,
                              lookup_threads=lookup_threads, lookup_cpus=lookup_cpus,
                              registration=registration,
                              mapped=(mapping.address, mapping.address + mapping.length))
        self._closed = False
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------ create --
    @classmethod
    def create(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *, group: Any = None,
               mode: CreateMode = "auto", checkpoint: Any = None,
               options: TableOptions | None = None,
               placement: str | PlacementPlan | None = None,
               directory: str | None = DEFAULT_DIRECTORY, register_device: int | None = None,
               timeout_s: float = 300.0, topology: Topology | None = None,
               names: TensorNames | None = None, progress: Progress | None = None,
               lookup_threads: int | None = None, page_size: PageSize | int = "4K",
               load_threads: int | None = None, shared_load: bool | None = None,
               stall_timeout_s: float | None = None, tier: str = "resident") -> SharedEngramTable:
        """Collective over ``group`` (its rank 0 leads; None: a private table).

        The table options below may come as keywords or, for many tables
        made alike, as one ``options=TableOptions(...)`` (not both).

        page_size: ``4K`` (a memfd, never a file: a group's members hand it
        over at sockets under $XDG_RUNTIME_DIR or the temporary directory,
        so /dev/shm's size does not matter; ``directory=None`` asks for
        private copies), ``2M`` or ``1G``
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
        (shares when the group has > 1 member, its members can map one
        table (host, user, the hand-over root or hugetlbfs mount) and there
        is room, else falls back to independent copies, when
        those fit in memory, with a warning).  Every member must pass the
        same layer, shard and mode.  Every collective is bounded by
        ``timeout_s``; a load waits as long as some loader makes progress
        (at most ``stall_timeout_s`` without any).
        Every member ends the same way: all return a table, or all raise the
        same class (our own, or MemberFailure) naming every failing member.

        tier: ``resident`` (the above: a table file loaded from the
        checkpoint) or ``mapped`` (the checkpoint's own bytes mapped
        read-only, nothing copied, one page-cache copy per host, evictable;
        not collective: each process maps the files itself, so ``group``,
        ``dp_shared``, placement, huge pages and ``register_device`` do not
        apply and are refused naming why; ``mappedtier``)."""
        asked = TableOptions(
            placement=placement, directory=directory, page_size=page_size,
            register_device=register_device, timeout_s=timeout_s, topology=topology, names=names,
            progress=progress, lookup_threads=lookup_threads, load_threads=load_threads,
            shared_load=shared_load, stall_timeout_s=stall_timeout_s).given_once(options)
        check_tier(tier)
        req = CreateRequest.of(spec, layer_id, shard, mode, checkpoint, asked)
        if tier == "mapped":
            built = mappedtier.engram_mapped(spec, layer_id, shard, mode, checkpoint,
                                             req.options)
        else:
            grp = SingleProcessGroup() if group is None else as_group(group)
            with grp.bounded(req.options.timeout_s):
                built = protocol.create(grp, req)
        table = cls(spec, layer_id, shard, built, requested_mode=mode,
                    lookup_threads=req.options.lookup_threads)
        log.info("Engram table: %s", table.mode_report())
        return table

    @classmethod
    def attach(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *,
               path: str | None = None, fd: int | None = None, service: str | None = None,
               peers: str | None = None, node: int | None = None,
               page_size: PageSize | int = "4K", register_device: int | None = None,
               timeout_s: float = 10.0, service_uids: Sequence[int] | None = None,
               allow_unsealed: bool | None = None) -> SharedEngramTable:
        """Map a READY table handed over outside a group, read-only, after
        the same checks a peer makes (spec, size, layer and shard): by its
        ``path`` (before the unlink), an ``fd`` passed over a Unix socket,
        or from the table service listening on ``service`` (its socket
        path: ``numa-engram serve``), which hands over the descriptor of
        this spec, layer, shard and ``page_size`` (its copy on ``node``,
        default the node this thread runs on, when it holds one per node),
        or from any process still holding a 4 KiB dp_shared table at its
        hand-over directory ``peers`` (a member's ``table.handover``): this
        process then holds it too, and hands it over in turn until close.
        ``register_device``: pin the mapping for zero-copy reads by that GPU.
        No per-byte work but the registration: O(1) in the table's size.
        A service is believed only when it runs as our uid, root or one of
        ``service_uids``, and its descriptor only when sealed against
        writes, growth and shrinking unless ``allow_unsealed`` (defaults:
        ``NUMA_ENGRAM_SERVICE_UIDS``, ``NUMA_ENGRAM_ALLOW_UNSEALED``)."""
        check_shard(spec, layer_id, shard)
        if sum(x is not None for x in (path, fd, service, peers)) != 1:
            raise ValueError("give exactly one of path=, fd=, service= or peers=")
        timeout_s = positive_seconds(timeout_s)
        peers = None if peers is None else fdhandover.handover_path(peers)
        started = time.perf_counter()
        here = current_node(Topology.detect())  # read once: the service's copy and our record
        received, owner_uid, mode = None, None, "attached"
        if service is not None:
            trust = serviceclient.ServiceTrust.of(service_uids, allow_unsealed)
            received, owner_uid = service_descriptor(spec, layer_id, shard, service,
                                                     here if node is None else node, page_size,
                                                     timeout_s, trust)
            fd, mode = received, "service"
        elif peers is not None:
            received, owner_uid = protocol.late_descriptor(
                spec, layer_id, shard, parse_page_size(page_size), peers, timeout_s)
            fd, mode = received, "dp_shared"
        try:
            built = protocol.attach_backing(spec, layer_id, shard, mode, here, started, path=path,
                                            fd=fd, owner_uid=owner_uid, peers=peers,
                                            register_device=register_device)
        finally:
            if received is not None:
                os.close(received)  # the backing holds its own duplicate
        try:
            table = cls(spec, layer_id, shard, built,
                        requested_mode="service" if service is not None else "attach")
        except BaseException:
            protocol.release(built)
            raise
        log.info("Engram table attached: layer %d heads [%d, %d) from %s in %s", layer_id,
                 shard.head_start, shard.head_end, service or peers or path or f"fd {fd}",
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in built.phases.items()))
        return table

    def dup_descriptor(self) -> int:
        """A new descriptor of the table's file (the caller closes it): what
        the table service keeps and hands over."""
        self._check_open()
        return os.dup(self._backing.fd)

    def readahead(self, hash_ids: Any, *, id_format: IdFormat = "bucket",
                  advise: bool = True) -> tuple[int, int]:
        """A mapped table: the pages of the rows ``hash_ids`` names (as
        ``lookup`` takes them) counted, those not in memory asked for
        (MADV_WILLNEED: the kernel reads exactly them) unless ``advise`` is
        False; returns (pages resident before, pages).  (0, 0) for a
        resident table, whose rows are always in memory."""
        self._check_open()
        arrays = mappedtier.mapped_arrays(self._backing)
        if arrays is None:
            return 0, 0
        rows = mappedtier.engram_rows(self.spec, self.layer_id, self.shard, hash_ids,
                                      self.id_base(id_format))
        w_hit, w_pages = arrays.readahead("weights", rows, self.spec.head_dim, advise=advise)
        s_hit, s_pages = arrays.readahead("scales", rows, self.spec.scales_per_row,
                                          advise=advise)
        return w_hit + s_hit, w_pages + s_pages

    def check_checkpoint(self) -> None:
        """A mapped table: CheckpointError naming a checkpoint file
        truncated, rewritten or replaced since it was mapped (an fstat and a
        stat per file; a lookup of a truncated page raises by itself)."""
        self._check_open()
        arrays = mappedtier.mapped_arrays(self._backing)
        if arrays is not None:
            arrays.check_unchanged()

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
        return self.rows.lookup(hash_ids, out, id_format=id_format, packed=packed)

    def bind_lookup(self, out: Any, *, packed: bool = False,
                    id_format: IdFormat = "bucket") -> Callable[[Any], Rows]:
        """``ShardRows.bind_lookup``: lookups into ``out`` with it checked once."""
        return self.rows.bind_lookup(out, packed=packed, id_format=id_format)

    def prepare_out(self, out: Any, *, packed: bool = False) -> PreparedOutput:
        """``ShardRows.prepare_out``: ``out`` checked and cast once."""
        return self.rows.prepare_out(out, packed=packed)

    @property
    def closed(self) -> bool:
        """Whether close() has run (metrics reads it of either table class)."""
        return self._closed

    @property
    def lookup_cpus(self) -> tuple[int, ...]:
        return self.rows.lookup_cpus

    @lookup_cpus.setter
    def lookup_cpus(self, cpus: Sequence[int]) -> None:
        self.rows.lookup_cpus = cpus

    @property
    def lookup_threads(self) -> int:
        return self.rows.lookup_threads

    @lookup_threads.setter
    def lookup_threads(self, threads: int) -> None:
        self.rows.lookup_threads = threads

    def id_base(self, id_format: IdFormat) -> np.ndarray | None:
        """Each shard head's first global row (None for bucket ids)."""
        return self.rows.id_base(id_format)

    def device_view(self) -> DeviceShard:
        """Zero-copy CUDA views of this shard (needs register_device=)."""
        return self.rows.device_view()

    def lookup_cuda(self, hash_ids: Any, out: Any = None, *, id_format: IdFormat = "bucket",
                    packed: bool = False, max_sms: int | None = None,
                    background: bool = False) -> Rows:
        """The lookup on the GPU that registered the table: one fused kernel
        reading rows over PCIe (zero-copy) and dequantising on the device;
        ids must already be on that GPU; no host sync (bad ids: zero rows,
        raised by ``check_device_errors()``).  See ``DeviceShard.lookup``."""
        return self.rows.lookup_cuda(hash_ids, out, id_format=id_format, packed=packed,
                                     max_sms=max_sms, background=background)

    def check_device_errors(self) -> None:
        """Raise LookupIdError for bad ids the GPU lookups met since the last
        check (reads the device record: one sync), and clear it."""
        self.rows.check_device_errors()

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
        lookups, rows, seconds, buckets, failures = self.rows.counts()
        latency = Histogram.of(buckets, seconds).snapshot()  # CPU lookups: GPU ones are launches
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
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.rows.close()
        # no view of the mapping may outlive close: empty arrays of the same
        # row shape stand in for the rows
        self.weights = np.empty((0, self.weights.shape[1]), np.uint8)
        self.scales = np.empty((0, self.scales.shape[1]), np.uint8)
        # device views still alive keep the registration (and the memory)
        # until they are dropped; without any, this unregisters now
        self.registration = None
        self._backing.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the table is closed")

    def __enter__(self) -> SharedEngramTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CREATE_MODES", "ModeReport", "SharedEngramTable", "TableStats", "table_layout"]
