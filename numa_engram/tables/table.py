"""SharedEngramTable: one shard of one Engram layer in host memory, one
physical copy per sharing group.

Its lifecycle (create through the tiers, attach, reports, close) is
``FamilyTable``'s; here: a shard named by its heads (a ``ShardInfo``), its
rows (``ShardRows``, which runs the lookups) and the Engram lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from ..checkpoints.checkpoint import Progress, TensorNames
from ..host.topology import Topology
from ..literals import DEFAULT_DIRECTORY, CreateMode, IdFormat, PageSize
from ..lookup.outputs import PreparedOutput
from ..lookup.shardrows import ShardRows
from ..model.sharding import ShardInfo
from ..model.spec import EngramSpec
from ..store.placement import PlacementPlan
from . import mappedtier
from .familytable import Counts, FamilyTable
from .protocol import Built
from .request import CREATE_MODES, TableOptions, check_shard, table_layout
from .tablereports import ModeReport, TableStats

if TYPE_CHECKING:
    import torch

    from ..lookup.gpu import DeviceShard
    from ..lookup.shardrows import Rows


class SharedEngramTable(FamilyTable):
    """Use ``SharedEngramTable.create(...)``; then ``lookup``, ``weights``,
    ``scales``, ``placement_report()``, ``mode_report()``, ``close()``
    (the lifecycle: ``FamilyTable``)."""

    spec: EngramSpec

    def _open_rows(self, built: Built, lookup_threads: int | None) -> None:
        spec, shard, backing = self.spec, self.shard, self._backing
        self.weights = backing.region("weights").reshape(shard.num_rows, spec.head_dim)
        self.scales = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)
        # the lookups (CPU and GPU), their kernel, outputs and counters
        mapping = backing.mapping  # no out= may share its bytes (a read-only one: a SIGSEGV)
        self.rows = ShardRows(spec, self.layer_id, shard, self.weights, self.scales,
                              lookup_threads=lookup_threads, lookup_cpus=built.lookup_cpus,
                              registration=self.registration,
                              mapped=(mapping.address, mapping.address + mapping.length))

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
            shared_load=shared_load, stall_timeout_s=stall_timeout_s)
        return cls._create(spec, layer_id, shard, group=group, mode=mode, checkpoint=checkpoint,
                           tier=tier, asked=asked, options=options)

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
        return cls._attach(spec, layer_id, shard, path=path, fd=fd, service=service, peers=peers,
                           node=node, page_size=page_size, register_device=register_device,
                           timeout_s=timeout_s, service_uids=service_uids,
                           allow_unsealed=allow_unsealed)

    def readahead(self, hash_ids: Any, *, id_format: IdFormat = "bucket",
                  advise: bool = True) -> tuple[int, int]:
        """A mapped table: the pages of the rows ``hash_ids`` names (as
        ``lookup`` takes them) counted, those not in memory asked for
        (MADV_WILLNEED: the kernel reads exactly them) unless ``advise`` is
        False; returns (pages resident before, pages).  (0, 0) for a
        resident table, whose rows are always in memory."""
        return self._read_ahead(lambda: mappedtier.engram_rows(
            self.spec, self.layer_id, self.shard, hash_ids, self.id_base(id_format)), advise)

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

    # ----------------------------------------------------- family hooks --
    def _lookup_counts(self) -> Counts:
        return self.rows.counts()

    def _family_report(self) -> dict[str, Any]:
        return {"embedding_dp_size": 1, "head_start": self.shard.head_start,
                "head_end": self.shard.head_end}

    def _describe(self) -> str:
        return f"layer {self.layer_id} heads [{self.shard.head_start}, {self.shard.head_end})"

    def _close_rows(self) -> None:
        self.rows.close()
        # no view of the mapping may outlive close: empty arrays of the same
        # row shape stand in for the rows
        self.weights = np.empty((0, self.weights.shape[1]), np.uint8)
        self.scales = np.empty((0, self.scales.shape[1]), np.uint8)


__all__ = ["CREATE_MODES", "ModeReport", "SharedEngramTable", "TableStats", "table_layout"]
