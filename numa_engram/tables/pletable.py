"""One ETP shard of one layer's Qwen4-Exp PLE table, made by the same
sharing protocol as an Engram table: one copy per sharing group (the DP
replicas holding the same row range), NUMA-placed, on 4K, 2M or 1G pages,
loaded from vLLM's split-parts checkpoint cooperatively, sealed once
loaded.

A rank looks up the rows it holds (zeros for rows another ETP rank holds);
``reduce_rows`` sums the ranks' raw row bytes as vLLM all-reduces FP8
(int8), so every rank ends with the whole table's rows, then turns FP8 into
BF16 through the per-tensor scale.  torch only inside the calls that hand
out tensors.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..bindings import lookupkernel
from ..checkpoints.checkpoint import Progress
from ..errors import LookupIdError, StorageError
from ..histogram import LOOKUP_BUCKETS
from ..host.topology import Topology
from ..literals import DEFAULT_DIRECTORY, CreateMode, PageSize
from ..lookup.cpu import default_lookup_threads
from ..lookup.ple import PLERows, row_ids
from ..model.ple import PLESpec
from ..model.sharding import ShardInfo
from ..model.spec import strict_int
from ..store.placement import PlacementPlan
from .familytable import Counts, FamilyTable
from .mappedtier import fixed_region
from .protocol import Built
from .request import TableOptions

if TYPE_CHECKING:
    import torch

    from ..lookup.gpu import PLEDeviceRows
    from ..lookup.outputs import PreparedOutput


class SharedPLETable(FamilyTable):
    """Rows ``shard.row_start .. shard.row_end`` of a PLE layer's table (the
    lifecycle: ``FamilyTable``)."""

    spec: PLESpec

    def _open_rows(self, built: Built, lookup_threads: int | None) -> None:
        spec, shard = self.spec, self.shard
        self.lookup_cpus = built.lookup_cpus
        self.lookup_threads = default_lookup_threads(self.lookup_cpus) \
            if lookup_threads is None else max(1, int(lookup_threads))
        # the node's lookup threads, shared with its other tables (lookupkernel.shared_workers)
        self._workers = lookupkernel.shared_workers(self.lookup_threads - 1, self.lookup_cpus) \
            if self.lookup_threads > 1 else None
        self._release = None if self._workers is None else \
            weakref.finalize(self, lookupkernel.release_workers, self._workers)
        self._device_rows: PLEDeviceRows | None = None
        self._failures = {"bad_ids": 0, "failed": 0}  # (the kernel counts the rest)
        # the kernel counts the lookups (rows, time, latency) and refuses them once closed
        self._state = lookupkernel.TableState(LOOKUP_BUCKETS)
        self._count_lock = threading.Lock()
        self.weights = self._backing.region("weights").reshape(shard.num_rows, spec.row_bytes)
        self.scale = float(fixed_region(self._backing, "scale")[:4].view(np.float32)[0]) \
            if spec.dtype == "float8_e4m3fn" else None
        self.rows = self._rows()

    @property
    def etp_rank(self) -> int:
        """The ETP rank whose rows these are (ranks split the rows evenly)."""
        return self.shard.row_start // self.shard.num_rows

    @property
    def etp_size(self) -> int:
        return int(self.spec.rows(self.layer_id)) // self.shard.num_rows

    @classmethod
    def create(cls, spec: PLESpec, layer_id: int, *, etp_rank: int = 0, etp_size: int = 1,
               group: Any = None, mode: CreateMode = "auto", checkpoint: Any = None,
               options: TableOptions | None = None,
               placement: str | PlacementPlan | None = None,
               directory: str | None = DEFAULT_DIRECTORY, page_size: PageSize | int = "4K",
               timeout_s: float = 300.0, load_threads: int | None = None,
               topology: Topology | None = None, progress: Progress | None = None,
               register_device: int | None = None,
               lookup_threads: int | None = None, tier: str = "resident") -> SharedPLETable:
        """Collective over ``group`` (the members holding the same ETP
        shard; its rank 0 leads; None: a private table), with the same
        modes, placements, page sizes, options (keywords or ``options=``)
        and failure rules as ``SharedEngramTable.create``.  ``checkpoint``:
        vLLM's split-parts safetensors (a file, files or directory).
        ``register_device``: pin the mapping for zero-copy reads by that
        CUDA device (``lookup_cuda``).  ``lookup_threads``: at most this
        many threads per CPU lookup (None: one per CPU of the table's node,
        at most 4; a call splits only where each thread gets enough rows).
        ``tier="mapped"``: the rows read in place from the checkpoint's parts
        (as ``SharedEngramTable.create``'s; the parts a shard spans must lie
        end to end in one file or meet at page boundaries)."""
        asked = TableOptions(
            placement=placement, directory=directory, page_size=page_size,
            register_device=register_device, timeout_s=timeout_s, topology=topology,
            progress=progress, lookup_threads=lookup_threads, load_threads=load_threads)
        return cls._create(spec, layer_id, _shard(spec, layer_id, etp_rank, etp_size),
                           group=group, mode=mode, checkpoint=checkpoint, tier=tier, asked=asked,
                           options=options)

    @classmethod
    def attach(cls, spec: PLESpec, layer_id: int, *, path: str | None = None,
               fd: int | None = None, service: str | None = None,
               peers: str | None = None, etp_rank: int = 0,
               etp_size: int = 1, node: int | None = None, page_size: PageSize | int = "4K",
               timeout_s: float = 10.0, service_uids: Sequence[int] | None = None,
               allow_unsealed: bool | None = None,
               register_device: int | None = None,
               lookup_threads: int | None = None) -> SharedPLETable:
        """Map the READY table of this ETP shard, read-only, after the checks
        a peer makes, as ``SharedEngramTable.attach`` does: by its ``path``,
        an ``fd``, from the table service on ``service`` (its copy on
        ``node``, default this thread's; the service believed under the same
        rules as for Engram tables), or from any process still holding a
        4 KiB dp_shared table at its hand-over directory ``peers`` (a
        member's ``table.handover``), which this process then holds and
        hands over in turn until close."""
        return cls._attach(spec, layer_id, _shard(spec, layer_id, etp_rank, etp_size),
                           path=path, fd=fd, service=service, peers=peers, node=node,
                           page_size=page_size, register_device=register_device,
                           timeout_s=timeout_s, service_uids=service_uids,
                           allow_unsealed=allow_unsealed, lookup_threads=lookup_threads)

    def store_scale(self, scale: float, *, write: bool = True) -> None:
        """The per-tensor scale a loader that fills the rows itself (vLLM's,
        under the plugin) read: written into the table (``write``: its
        writer), and used by this mapping's lookups."""
        self._check_open()
        if self.spec.dtype != "float8_e4m3fn":
            raise StorageError(f"a {self.spec.dtype} PLE table has no scale")
        region = self._backing.region("scale")
        if write and not region.flags.writeable:
            raise StorageError("this PLE table is mapped read-only here; its writer stores "
                               "the scale")
        if write:
            region[:4] = np.frombuffer(np.float32(scale).tobytes(), dtype=np.uint8)
        self.scale = float(np.float32(scale))
        self.rows = self._rows()

    def _rows(self) -> PLERows:
        mapping = self._backing.mapping  # no out= may share its bytes (read-only: a SIGSEGV)
        return PLERows(self.weights, dtype=self.spec.dtype, row_start=self.shard.row_start,
                       total_rows=self.spec.rows(self.layer_id), scale=self.scale,
                       workers=self._workers,
                       mapped=(mapping.address, mapping.address + mapping.length),
                       state=self._state)

    def readahead(self, ids: Any, *, advise: bool = True) -> tuple[int, int]:
        """A mapped table: the pages of this shard's rows among ``ids``
        (layer row ids, as ``lookup`` takes them) counted, those not in
        memory asked for (MADV_WILLNEED) unless ``advise`` is False;
        returns (pages resident before, pages).  (0, 0) when resident."""
        return self._read_ahead(lambda: self._local_rows(ids), advise)

    def _local_rows(self, ids: Any) -> np.ndarray:
        local = row_ids(ids).reshape(-1) - self.shard.row_start
        return np.unique(local[(local >= 0) & (local < self.shard.num_rows)])

    # ----------------------------------------------------- family hooks --
    def _lookup_counts(self) -> Counts:
        with self._count_lock:
            failures = dict(self._failures)
        lookups, rows, seconds, buckets = self._state.counts()
        return int(lookups), int(rows), float(seconds), buckets, failures

    def _family_report(self) -> dict[str, Any]:
        return {"etp_rank": self.etp_rank, "etp_size": self.etp_size}

    def _describe(self) -> str:
        return (f"layer {self.layer_id} rows [{self.shard.row_start}, {self.shard.row_end}) "
                f"of ETP rank {self.etp_rank}/{self.etp_size}")

    def _close_rows(self) -> None:
        self._state.close()  # later lookups refused; the running ones finish first
        empty = np.empty((0, self.spec.row_bytes), dtype=np.uint8)
        self.weights = empty
        self.rows = PLERows(empty, dtype=self.spec.dtype, row_start=0, total_rows=0,
                            scale=self.scale)
        if self._release is not None:
            self._release()  # the last table on these CPUs stops the threads
        self._workers = None
        self._device_rows = None  # device views still alive keep the registration

    # ------------------------------------------------------------ lookup --
    def _lookup_failed(self, exc: Exception) -> None:
        """A lookup's failure ``exc``: the closed error when close() has run
        (a lookup after it meets the emptied rows), else counted (the kernel
        counts the lookups: no clock, lock or check per call here, the
        decode budget)."""
        if self._closed:
            raise self._closed_error() from None
        self._count_failure("bad_ids" if isinstance(exc, LookupIdError) else "failed")

    def _count_failure(self, failure: str) -> None:
        with self._count_lock:
            self._failures[failure] += 1

    def lookup(self, ids: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """BF16 ``[*ids.shape, head_dim]``: this shard's rows of layer-table
        row ids, zeros where another shard holds the row (into ``out``, a
        contiguous CPU bfloat16 tensor of that shape, or what ``prepare_out``
        made of one, when given; without it a tensor of the table's, reused
        once nothing refers to it)."""
        try:
            return self.rows.lookup(ids, out)
        except Exception as exc:
            self._lookup_failed(exc)
            raise

    def prepare_out(self, out: torch.Tensor) -> PreparedOutput:
        """``out`` checked and cast once for ``lookup(ids, out=...)`` call
        after call (a staging buffer): a call then checks only that the ids
        lie apart from it (``PLERows.prepare_out``)."""
        self._check_open()
        return self.rows.prepare_out(out)

    def device_rows(self) -> PLEDeviceRows:
        """The GPU lookup on this shard's registered rows (needs
        ``register_device=``)."""
        from ..lookup.gpu import PLEDeviceRows

        self._check_open()
        if self.registration is None:
            raise StorageError("the PLE table is not registered with CUDA; create or attach "
                               "it with register_device=<cuda device index>")
        if self._device_rows is None:
            self._device_rows = PLEDeviceRows.on_host(
                self.weights, self.registration.device, dtype=self.spec.dtype,
                row_start=self.shard.row_start, total_rows=self.spec.rows(self.layer_id),
                scale=self.scale, lease=self.registration)
        return self._device_rows

    def lookup_cuda(self, ids: Any, out: Any = None, *, packed: bool = False,
                    max_sms: int | None = None, background: bool = False) -> torch.Tensor:
        """``lookup`` on the registering GPU, ids on that GPU: one Triton
        kernel, no host sync (bad ids: ``device_rows().check_errors()``)."""
        return self.device_rows().lookup(ids, out, packed=packed, max_sms=max_sms,
                                         background=background)

    def lookup_packed(self, ids: Any) -> np.ndarray:
        """The stored bytes ``[*ids.shape, row_bytes]`` (zeros likewise)."""
        try:
            return self.rows.rows_packed(ids)
        except Exception as exc:
            self._lookup_failed(exc)
            raise


def _shard(spec: PLESpec, layer_id: int, etp_rank: Any, etp_size: Any) -> ShardInfo:
    """ETP rank ``etp_rank`` of ``etp_size``'s rows of the layer."""
    return spec.shard(layer_id, strict_int(etp_rank, "etp_rank"),
                      strict_int(etp_size, "etp_size"))


def reduce_rows(table: SharedPLETable, ids: Any, process_group: Any = None) -> torch.Tensor:
    """BF16 ``[*ids.shape, head_dim]`` rows of the whole layer table on every
    ETP rank: each rank's stored bytes summed over ``process_group`` (its
    ETP group; None: the default group) as integers, exactly one rank
    holding each row, then the FP8 bytes scaled.  Collective: every ETP
    rank calls it with the same ids."""
    import torch
    import torch.distributed as dist

    packed = torch.from_numpy(table.lookup_packed(ids))
    wide = packed.view(torch.int8) if table.spec.dtype == "float8_e4m3fn" \
        else packed.view(torch.int16)
    dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=process_group)
    whole = packed.numpy()
    if table.spec.dtype == "bfloat16":
        return torch.from_numpy(whole.view(np.uint16)).view(torch.bfloat16)
    flat = whole.reshape(-1, table.spec.row_bytes)
    summed = PLERows(np.ascontiguousarray(flat), dtype="float8_e4m3fn", row_start=0,
                     total_rows=len(flat), scale=table.scale)
    out = summed.rows_bf16(np.arange(len(flat))).reshape(*whole.shape[:-1], -1)
    return torch.from_numpy(out).view(torch.bfloat16)
