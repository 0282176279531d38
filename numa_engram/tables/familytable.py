"""FamilyTable: the lifecycle every family's table shares, written once.

``create`` checks its options once, asks the tier (``tiers.TIERS``) to
build this member's table (the resident tier: the leader/peer protocol
over the group, bounded by the request's timeout; docs/design.md, "Order
of operations"); ``attach`` maps a READY table by its path, a descriptor,
the table service or a group's holders; then the reports (``stats`` with
the lookups' latency, ``mode_report``, ``placement_report``), the mapped
tier's read-ahead and checkpoint check, and ``close`` under a lock.

A family's subclass (``SharedEngramTable``, ``SharedPLETable``) supplies
only what differs: how its shard is named from its arguments, its rows
object (``_open_rows``, ``_close_rows``, ``_lookup_counts``), its lookups,
its mode report's own keys (``_family_report``) and its log lines
(``_describe``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..errors import StorageError
from ..histogram import Histogram
from ..host.hugepages import parse_page_size
from ..host.topology import Topology, current_node
from ..literals import PageSize
from ..model.families import family_of
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..store import fdhandover, serviceclient
from ..store.placement import PlacementReport, verify
from . import protocol
from .mappedtier import mapped_arrays
from .membership import identity_key
from .protocol import Built
from .request import CreateRequest, TableOptions, positive_seconds
from .tablereports import ModeReport, TableStats, accounted_bytes, service_descriptor
from .tiers import tier_named

log = logging.getLogger(__name__)

T = TypeVar("T", bound="FamilyTable")
# (lookups, rows, CPU seconds, the CPU latency buckets, failed lookups by why)
Counts = tuple[int, int, float, Sequence[int], dict[str, int]]


class FamilyTable:
    """One shard of one layer's table of some family, one physical copy
    per sharing group; made by a subclass's ``create`` or ``attach``."""

    spec: Any  # the family's spec (a TableFamily)
    lookup_threads: int
    lookup_cpus: tuple[int, ...]

    def __init__(self, spec: TableFamily, layer_id: int, shard: ShardInfo, built: Built, *,
                 requested_mode: str, lookup_threads: int | None = None) -> None:
        """A table from what a tier (or an attach) made: ``built``."""
        self.spec, self.layer_id, self.shard = spec, layer_id, shard
        self._backing = backing = built.backing
        # seconds of this member's create steps (checks, create, populate, map, register, load)
        self.startup_phases = dict(built.phases)
        self.mode, self.requested_mode = built.mode, requested_mode
        # "resident" (a table file) or "mapped" (the checkpoint's pages: mappedtier)
        self.tier: str = getattr(backing, "tier", "resident")
        self.members, self.leader = built.members, built.leader
        self.plan, self._report = built.plan, built.report
        self.registration = built.registration  # a cudart.RegistrationLease, or None
        self.fallback_reason = built.fallback_reason
        self._closed = False
        self._close_lock = threading.Lock()
        self._open_rows(built, lookup_threads)

    # ----------------------------------------------------- family hooks --
    def _open_rows(self, built: Built, lookup_threads: int | None) -> None:
        """The family's rows object over ``self._backing``'s regions."""
        raise NotImplementedError

    def _close_rows(self) -> None:
        """Refuse later lookups (running ones finish), let go of the rows."""
        raise NotImplementedError

    def _lookup_counts(self) -> Counts:
        """The rows object's counters (``Counts``)."""
        raise NotImplementedError

    def _family_report(self) -> dict[str, Any]:
        """The mode report's keys of the family (how its shard is named)."""
        raise NotImplementedError

    def _describe(self) -> str:
        """The shard in a log line ("layer 3 heads [0, 4)")."""
        raise NotImplementedError

    # ------------------------------------------------------------ create --
    @classmethod
    def _create(cls: type[T], spec: TableFamily, layer_id: int, shard: ShardInfo, *,
                group: Any, mode: str, checkpoint: Any, tier: str, asked: TableOptions,
                options: TableOptions | None) -> T:
        """The subclass's ``create``: ``asked`` (its keywords) or ``options``."""
        asked = asked.given_once(options)
        builder = tier_named(tier)
        req = CreateRequest.of(spec, layer_id, shard, mode, checkpoint, asked)
        built = builder.build(group, req)
        table = cls._made(spec, layer_id, shard, built, mode, req.options.lookup_threads)
        log.info("%s table: %s", table.title, table.mode_report())
        return table

    @classmethod
    def create_shard(cls: type[T], spec: TableFamily, layer_id: int, shard: ShardInfo, *,
                     checkpoint: Any, options: TableOptions) -> T:
        """The table of ``shard`` (the rows the family gives one TP rank:
        ``Family.shard``) made alone, resident, mode independent: what the
        table service holds, whatever the family."""
        return cls._create(spec, layer_id, shard, group=None, mode="independent",
                           checkpoint=checkpoint, tier="resident", asked=TableOptions(),
                           options=options)

    @classmethod
    def _made(cls: type[T], spec: TableFamily, layer_id: int, shard: ShardInfo, built: Built,
              requested_mode: str, lookup_threads: int | None) -> T:
        """The table of ``built``, which is released if that fails."""
        try:
            return cls(spec, layer_id, shard, built, requested_mode=requested_mode,
                       lookup_threads=lookup_threads)
        except BaseException:
            protocol.release(built)
            raise

    # ------------------------------------------------------------ attach --
    @classmethod
    def _attach(cls: type[T], spec: TableFamily, layer_id: int, shard: ShardInfo, *,
                path: str | None, fd: int | None, service: str | None, peers: str | None,
                node: int | None, page_size: PageSize | int, register_device: int | None,
                timeout_s: float, service_uids: Sequence[int] | None,
                allow_unsealed: bool | None, lookup_threads: int | None = None) -> T:
        """The subclass's ``attach`` (its docstring) of a checked shard."""
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
            mode = "service"
        elif peers is not None:
            received, owner_uid = protocol.late_descriptor(
                spec, layer_id, shard, parse_page_size(page_size), peers, timeout_s)
            mode = "dp_shared"
        try:
            built = protocol.attach_backing(spec, layer_id, shard, mode, here, started, path=path,
                                            fd=fd if received is None else received,
                                            owner_uid=owner_uid, peers=peers,
                                            register_device=register_device)
        finally:
            if received is not None:
                os.close(received)  # the backing holds its own duplicate
        table = cls._made(spec, layer_id, shard, built,
                          "service" if service is not None else "attach", lookup_threads)
        log.info("%s table attached: %s from %s in %s", table.title, table._describe(),
                 service or peers or path or f"fd {fd}",
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in built.phases.items()))
        return table

    def dup_descriptor(self) -> int:
        """A new descriptor of the table's file (the caller closes it): what
        the table service keeps and hands over."""
        self._check_open()
        return os.dup(self._backing.fd)

    # (what the backing knows is asked of it: an instance's attributes stay
    # few enough for CPython to share their keys, which a lookup's reads of
    # them cost least with)
    @property
    def path(self) -> str:
        """The table's file (a memfd's name), or a mapped table's checkpoint files."""
        return self._backing.path

    @property
    def handover(self) -> str | None:
        """Where a process that was not in the create attaches (``peers=``):
        the hand-over directory of a 4 KiB dp_shared table, else None."""
        return self._backing.handover_directory

    @property
    def backing_bytes(self) -> int:
        """The bytes of the table's file (a mapped table: of its rows)."""
        return int(self._backing.layout.file_size)

    @property
    def backing(self) -> Any:
        """The table's file (a BackingFile), or a mapped table's checkpoint
        mapping (``mappedtier.MappedBacking``)."""
        return self._backing

    @property
    def title(self) -> str:
        """The family's name in messages ("Engram", "PLE")."""
        return family_of(self.spec).title

    # ------------------------------------------------------- mapped tier --
    def _read_ahead(self, local_rows: Callable[[], np.ndarray], advise: bool) -> tuple[int, int]:
        """A mapped table: the pages of the shard rows ``local_rows()``
        gives (the family's reading of a lookup's ids) in each row region
        counted, those not in memory asked for (MADV_WILLNEED) unless
        ``advise`` is False; (pages resident before, pages).  (0, 0) for a
        resident table, whose rows are always in memory."""
        self._check_open()
        arrays = mapped_arrays(self._backing)
        if arrays is None:
            return 0, 0
        rows = local_rows()
        counted = [arrays.readahead(name, rows, width, advise=advise)
                   for name, width in self.spec.row_regions()]
        return sum(hit for hit, _ in counted), sum(pages for _, pages in counted)

    def check_checkpoint(self) -> None:
        """A mapped table: CheckpointError naming a checkpoint file
        truncated, rewritten or replaced since it was mapped (an fstat and a
        stat per file; a lookup of a truncated page raises by itself)."""
        self._check_open()
        arrays = mapped_arrays(self._backing)
        if arrays is not None:
            arrays.check_unchanged()

    # ----------------------------------------------------------- reports --
    def placement_report(self, refresh: bool = True) -> PlacementReport | None:
        """Where this member sees the pages against the plan, page by page
        (None without a plan); re-measured unless ``refresh=False``."""
        self._check_open()
        if self.plan is None:
            return None
        if refresh or self._report is None:
            self._report = verify(self._backing.mapping, self.plan)
        return self._report

    def stats(self) -> TableStats:
        """Counters since creation and the last placement report's figures
        (the metrics endpoint's)."""
        report = self._report
        lookups, rows, seconds, buckets, failures = self._lookup_counts()
        latency = Histogram.of(buckets, seconds).snapshot()  # CPU lookups: GPU ones are launches
        physical = accounted_bytes(self.mode, self.leader, self.backing_bytes)
        return TableStats(self.layer_id, self.shard.head_start, self.shard.head_end, self.mode,
                          self.backing_bytes, lookups, rows, rows * self.spec.row_bytes, seconds,
                          None if report is None else report.fraction_on_plan,
                          report.bytes_per_node() if report is not None else {},
                          physical, failures["bad_ids"], failures["failed"], latency)

    def mode_report(self) -> ModeReport:
        """What this member really runs (JSON-ready): mode, shard, group,
        placement, lookups, start-up; with the family's own keys."""
        report = self._report
        common: ModeReport = {
            "family": family_of(self.spec).name, "tier": self.tier,
            "mode": self.mode, "requested_mode": self.requested_mode,
            "fallback_reason": self.fallback_reason, "layer_id": self.layer_id,
            "row_start": self.shard.row_start, "row_end": self.shard.row_end,
            "num_rows": self.shard.num_rows,
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
        common.update(self._family_report())  # type: ignore[typeddict-item]
        return common

    # ------------------------------------------------------------- close --
    @property
    def closed(self) -> bool:
        """Whether close() has run (metrics reads it of every table)."""
        return self._closed

    def close(self) -> None:
        """Unregister, unmap (idempotent, once whatever the threads).  Marked
        closed first, so a lookup racing it says closed; lookups already
        running finish normally, later ones raise StorageError.  Views
        handed out stay valid until they are dropped."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close_rows()
        # device views still alive keep the registration (and the memory)
        # until they are dropped; without any, this unregisters now
        self.registration = None
        self._backing.close()

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> StorageError:
        return StorageError(f"{self.title} table layer {self.layer_id} is closed; create or "
                            "attach it again")

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
