"""SharedEngramTable: one shard of one Engram layer in host memory, one
physical copy per sharing group.

``create`` is the leader/peer protocol of DESIGN.md section 3, written as
one visible sequence of named steps; every collective is bounded by the
group's timeout, and a failure anywhere ends with the same clear exception
in every member and nothing left in /dev/shm.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import errors
from ..bindings import native
from ..errors import (
    LookupIdError,
    NumaEngramError,
    PlacementError,
    SpecError,
    SpecMismatchError,
    StorageError,
    TopologyError,
)
from ..host import hugepages, procfs
from ..host.accounting import check_memory
from ..host.topology import Topology, current_node, gpu_node
from ..lookup.cpu import (
    ID_FORMATS,
    OutputPool,
    bad_id_text,
    check_hash_ids,
    id_base,
)
from ..model.fp8 import bf16_out
from ..model.sharding import ShardInfo, prefix_offsets
from ..model.spec import EngramSpec
from ..store.fileformat import DEFAULT_DIRECTORY, STATE_READY, Layout, ShardKey
from ..store.placement import PlacementPlan, PlacementReport, Region, plan_placement, verify
from ..store.storage import BackingFile, check_directory_room, describe_device, directory_id
from .checkpoint import CheckpointPlan, Progress, TensorNames
from .checkpoint import resolve as resolve_checkpoint
from .group import Group, SingleProcessGroup, as_group
from .loading import bytes_done, load_part, load_parts, loaders_of, wait_for_parts

log = logging.getLogger(__name__)

CREATE_MODES = ("auto", "dp_shared", "independent")
DEFAULT_POLICY = "gpu-local"
# Test hook: called with "before-<step>" and "after-<step>" of each protocol
# step (join, decide, create, map, unlink, load, ready; and "load-progress")
# e.g. to kill the leader between create and unlink.  None in production.
_STEP_HOOK: Callable[[str], None] | None = None
# The last step is a short all-gather that every member reaches at once
# (after the load): bounded by this, so a member lost there costs little.
ACK_TIMEOUT_S = 10.0


def _step(name: str) -> None:
    if _STEP_HOOK is not None:
        _STEP_HOOK(name)


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
    lookup_seconds: float   # CPU lookups' wall time (GPU time: the scheduler's CUDA events)
    fraction_on_plan: float | None
    bytes_per_node: dict[int, int]


@dataclass(frozen=True)
class MemberInfo:
    rank: int  # world rank
    pid: int
    uid: int
    node: int
    device: int | None
    fingerprint: bytes
    key: ShardKey = ShardKey()
    mode: str = "auto"
    boot_id: bytes = b""
    directory_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the table directory
    hostname: str = ""
    directory: str = ""
    page_size: int = native.PAGE_SIZE
    directory_problem: str = ""  # why this member has no directory for the table
    placement: str | None = None  # as this member asked for it (None: follow the leader)


@dataclass(frozen=True)
class Outcome:
    """What one member reports after a step: ok (with a value), or its
    error as (type name, message, structured fields)."""

    ok: bool
    error_type: str = ""
    message: str = ""
    value: Any = None
    fields: dict = field(default_factory=dict)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, Outcome]:
    """Run one member's part of a step; every Exception becomes an Outcome
    the others see (KeyboardInterrupt and SystemExit still propagate)."""
    try:
        return fn(), Outcome(True)
    except Exception as exc:
        log.debug("member step failed", exc_info=True)
        fields = exc.fields() if isinstance(exc, NumaEngramError) else {}
        return None, Outcome(False, type(exc).__name__, str(exc), fields=fields)


def _error_class(type_name: str) -> type[NumaEngramError] | None:
    cls = getattr(errors, type_name, None)
    return cls if isinstance(cls, type) and issubclass(cls, NumaEngramError) else None


def _cause(outcomes: list[Outcome]) -> Outcome:
    """The failure that explains the others: the first that is not a
    loader's echo of another member's failed load."""
    failed = [o for o in outcomes if not o.ok]
    return next((o for o in failed if o.error_type != errors.PeerLoadFailed.__name__), failed[0])


def _raise_failures(outcomes: list[Outcome], ranks: tuple[int, ...], step: str) -> None:
    """The same exception in every member: the failing member's class (ours
    as itself, with its fields; anything else as MemberFailure); the
    message names every failing member."""
    failures = [(member, ranks[member] if member < len(ranks) else member, step,
                 o.error_type, o.message) for member, o in enumerate(outcomes) if not o.ok]
    if not failures:
        return
    cause = _cause(outcomes)
    cls = _error_class(cause.error_type) or errors.MemberFailure
    if len(failures) == 1:
        member, rank, _, type_name, message = failures[0]
        text = (f"sharing group failed at step '{step}' on member {member} (rank {rank}): "
                f"{message}")
    else:
        text = f"sharing group failed at step '{step}' on {len(failures)} members: " + "; ".join(
            f"member {m} (rank {r}) {t}: {msg}" for m, r, _, t, msg in failures)
    exc = cls.rebuild(text, cause.fields)
    exc.failures = failures
    raise exc


def _lead(grp: Group, step: str, fn: Callable[[], Any]) -> Any:
    """A step only the leader works in: its outcome (and value) broadcast;
    every member raises alike when it failed."""
    _step(f"before-{step}")
    outcome = None
    if grp.rank == 0:
        value, outcome = _attempt(fn)
        outcome = Outcome(True, value=value) if outcome.ok else outcome
    outcome = grp.broadcast(outcome, step)
    _step(f"after-{step}")
    _raise_failures([outcome], grp.ranks[:1], step)
    return outcome.value


def _all(grp: Group, step: str, fn: Callable[[], Any]) -> tuple[Any, list[Outcome]]:
    """A step every member works in: its value, and every member's outcome
    (the caller raises alike from them with ``_raise_failures``)."""
    _step(f"before-{step}")
    value, outcome = _attempt(fn)
    outcomes = grp.all_gather(Outcome(True, value=value) if outcome.ok else outcome, step)
    _step(f"after-{step}")
    return value, outcomes


def _as_group(group: Any, timeout_s: float) -> Group:
    """None: a private table; anything else adapted by ``as_group``."""
    return SingleProcessGroup() if group is None else as_group(group, timeout_s)


def table_layout(spec: EngramSpec, shard: ShardInfo, page_size: int = native.PAGE_SIZE) -> Layout:
    return Layout.of([("weights", shard.num_rows * spec.head_dim),
                      ("scales", shard.num_rows * spec.scales_per_row)], page_size)


class SharedEngramTable:
    """Use ``SharedEngramTable.create(...)``; then ``lookup``, ``weights``,
    ``scales``, ``placement_report()``, ``mode_report()``, ``close()``."""

    def __init__(self, spec: EngramSpec, layer_id: int, shard: ShardInfo, backing: BackingFile,
                 *, mode: str, requested_mode: str, members: list[MemberInfo], leader: bool,
                 plan: PlacementPlan | None, report: PlacementReport | None,
                 registration: Any = None, fallback_reason: str = "",
                 lookup_threads: int = 1, lookup_cpus: tuple[int, ...] = ()) -> None:
        self.spec, self.layer_id, self.shard = spec, layer_id, shard
        self._backing = backing
        self.mode, self.requested_mode = mode, requested_mode
        self.members, self.leader = members, leader
        self.plan, self._report = plan, report
        self.registration = registration
        self.fallback_reason = fallback_reason
        self.lookup_threads, self.lookup_cpus = lookup_threads, lookup_cpus
        self.path = backing.path
        self.backing_bytes = backing.layout.file_size
        self.weights = backing.region("weights").reshape(shard.num_rows, spec.head_dim)
        self.scales = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)
        self._bucket_sizes = np.asarray(
            spec.bucket_sizes(layer_id)[shard.head_start:shard.head_end], dtype=np.int64)
        # the kernel's fixed arguments, cast once: a call adds only ids and output
        self._geometry = native.Geometry.of(
            self.weights, self.scales, prefix_offsets(self._bucket_sizes), self._bucket_sizes,
            self.id_base("global"), spec.block)
        self._workers: native.Workers | None = None  # made at the first threaded lookup
        self._n_cols, self._row_shape = spec.n_hash_cols, (shard.num_heads, spec.head_dim)
        self._device_shard = None
        self._closed = False
        # lookups in flight: close() waits for them (they finish normally)
        self._active = 0
        self._idle = threading.Condition()
        self._outputs = OutputPool()  # lookup(ids) without out= reuses freed outputs
        self._counts = {"lookups": 0, "rows": 0, "seconds": 0.0}

    # ------------------------------------------------------------ create --
    @classmethod
    def create(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *, group: Any = None,
               placement: str | PlacementPlan | None = None,
               directory: str = DEFAULT_DIRECTORY, checkpoint: Any = None,
               register_device: int | None = None, timeout_s: float = 300.0,
               mode: str = "auto", topology: Topology | None = None,
               names: TensorNames | None = None, progress: Progress | None = None,
               lookup_threads: int = 1, page_size: str | int = "4K",
               load_threads: int | None = None) -> SharedEngramTable:
        """Collective over ``group`` (its rank 0 leads; None: a private table).

        page_size: ``4K`` (shmem: /dev/shm or a memfd), ``2M`` or ``1G``
        (hugetlb: a hugetlbfs mount of that size, found in /proc/self/mounts
        when ``directory`` is left at its default, or an MFD_HUGETLB memfd;
        each planned node's pool must have the pages free).

        load_threads: threads that pre-fault the table and copy the
        checkpoint, pinned to the CPUs of the node the rows are bound to
        (None: one per CPU this process may use, at most 8; 1: the plain
        single-thread copy).

        mode: ``dp_shared`` (one copy for the group; fails loudly when it
        cannot share), ``independent`` (each member its own copy) or ``auto``
        (shares when the group has > 1 member, its members can map one file
        and the tmpfs has room, else falls back to independent copies, when
        those fit in memory, with a warning).  Every member must pass the
        same layer, shard and mode.  Every collective is bounded by
        ``timeout_s``; a load waits as long as the loader makes progress.
        Every member ends the same way: all return a table, or all raise the
        same class (our own, or MemberFailure) naming every failing member."""
        if mode not in CREATE_MODES:
            raise SpecError(f"mode must be one of {CREATE_MODES}, got {mode!r}")
        _check_shard(spec, layer_id, shard)
        page = hugepages.parse_page_size(page_size)
        grp = _as_group(group, timeout_s)
        with grp.bounded(timeout_s):
            return cls._create(spec, layer_id, shard, grp, placement=placement,
                               directory=directory, checkpoint=checkpoint,
                               register_device=register_device, timeout_s=timeout_s, mode=mode,
                               topology=topology, names=names, progress=progress,
                               lookup_threads=lookup_threads, page_size=page,
                               load_threads=load_threads or _default_load_threads())

    @classmethod
    def _create(cls, spec, layer_id, shard, grp: Group, *, placement, directory, checkpoint,
                register_device, timeout_s, mode, topology, names, progress,
                lookup_threads, page_size, load_threads) -> SharedEngramTable:
        topo = topology or Topology.detect()
        layout = table_layout(spec, shard, page_size)
        key = shard_key(layer_id, shard)
        me, joined = _attempt(lambda: _member_info(grp, topo, register_device, spec, key, mode,
                                                   directory, page_size, placement, layout))
        _, outcomes = _all(grp, "join", lambda: _raise_unless(joined) or me)     # everyone here
        _raise_failures(outcomes, grp.ranks, "join")
        members = [o.value for o in outcomes]
        directory = me.directory or None  # this member's (a hugetlbfs mount for huge pages)
        # the leader resolves the whole checkpoint (files, tensors, offsets, the
        # spec) before anything is decided or allocated: a wrong tensor fails
        # in a second, not after a populate; every loader reads that plan
        ckpt, actual, reason = _lead(grp, "decide", lambda: (
            _resolve(checkpoint, spec, layer_id, names),
            *_decide(mode, members, layout, directory)))
        if actual == "independent":
            if reason and grp.size > 1:
                log.warning("Engram layer %d: sharing falls back to independent copies: %s",
                            layer_id, reason)
                if grp.rank != 0:  # another host may keep the checkpoint elsewhere
                    ckpt = _resolve(checkpoint, spec, layer_id, names)
            # a private copy needs no path: an anonymous memfd, never in /dev/shm
            grp, members, directory = SingleProcessGroup(), [me], None
        args = dict(placement=placement, directory=directory, checkpoint=ckpt,
                    register_device=register_device, topology=topo, names=names,
                    progress=progress, timeout_s=timeout_s, key=key,
                    load_threads=load_threads)
        table = cls._share(spec, layer_id, shard, grp, members, layout, **args)
        table.mode, table.requested_mode, table.fallback_reason = actual, mode, reason
        table.lookup_threads = lookup_threads
        table.lookup_cpus = _reader_cpus(table.plan, topo)
        log.info("Engram table: %s", table.mode_report())
        return table

    @classmethod
    def _share(cls, spec, layer_id, shard, grp: Group, members, layout, *, placement, directory,
               checkpoint, register_device, topology, names, progress, timeout_s,
               key, load_threads) -> SharedEngramTable:
        """DESIGN.md section 3, steps 1-10, for a group that shares one file."""
        leader = grp.rank == 0
        state: dict[str, Any] = {"backing": None, "registration": None, "report": None}
        try:
            # steps 1-7 (leader): plan, check, create, size, map, no THP, bind, populate, verify
            path, plan, cooperative = _lead(grp, "create", lambda: _leader_create(
                state, layout, spec.fingerprint, directory, placement, members, topology,
                key, load_threads))
            # who loads which rows: the members on the rows' node(s), else the leader
            parts = load_parts(shard.num_rows, [m.node for m in members], _bound_nodes(plan),
                               cooperative and checkpoint is not None)
            part = parts[grp.rank]
            # step 8: every member maps the file (by the leader's path) and registers it
            _, outcomes = _all(grp, "map", lambda: _member_map(
                state, leader, path, directory, spec, layout, key, register_device,
                writable=part[1] > part[0]))
            _raise_failures(outcomes, grp.ranks, "map")
            # step 9: all mapped, so the path can go; step 10: the loaders load
            _step("before-unlink")
            if leader:
                state["backing"].unlink()
            _step("after-unlink")
            _step("before-load")
            _, loaded = _attempt(lambda: _load(
                state["backing"], spec, layer_id, shard, checkpoint, names,
                (progress or _log_progress(layer_id)) if leader else None, parts, grp.rank,
                load_threads, _reader_cpus(plan, topology), timeout_s))
            _step("after-load")
            # the last step is acknowledged by everyone: all end the same way
            with grp.bounded(min(timeout_s, ACK_TIMEOUT_S)):
                _, outcomes = _all(grp, "ready", lambda: _raise_unless(loaded))
            _raise_failures(outcomes, grp.ranks, "ready")
        except BaseException:
            _cleanup(state["backing"], state["registration"])
            raise
        backing = state["backing"]
        if checkpoint is not None and backing.mapping.writable:
            backing.seal()  # loaded: read-only from now on, in every member
        return cls(spec, layer_id, shard, backing, mode="dp_shared" if grp.size > 1 else
                   "independent", requested_mode="", members=list(members), leader=leader,
                   plan=plan, report=state["report"], registration=state["registration"])

    @classmethod
    def attach(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *,
               path: str | None = None, fd: int | None = None) -> SharedEngramTable:
        """Map a READY table handed over outside a group (its path before the
        unlink, or an fd passed over a Unix socket), read-only, after the
        same checks a peer makes (spec, size, layer and shard)."""
        _check_shard(spec, layer_id, shard)
        backing = BackingFile.attach(path, fd=fd, fingerprint=spec.fingerprint,
                                     key=shard_key(layer_id, shard),
                                     layout_for=lambda page: table_layout(spec, shard, page))
        try:
            if backing.state != STATE_READY:
                raise StorageError(f"table {backing.path} is not READY (its creator has not "
                                   "finished loading it); attach after create() returned")
            me = MemberInfo(0, os.getpid(), os.geteuid(), current_node(Topology.detect()), None,
                            spec.fingerprint, shard_key(layer_id, shard), "attach")
            return cls(spec, layer_id, shard, backing, mode="attached",
                       requested_mode="attach", members=[me], leader=False, plan=None,
                       report=None)
        except BaseException:
            backing.close()  # a failed attach keeps no descriptor
            raise

    # ------------------------------------------------------------ lookup --
    def lookup(self, hash_ids, out=None, *, id_format: str = "bucket", dequantize: bool = True):
        """BF16 ``[T, heads_in_shard, head_dim]`` rows for ``hash_ids
        [T, n_hash_cols]`` (int64 or int32; rows may be strided, e.g.
        ``out[:, i]`` of ``HashState.hash``); DEAD_ID (-1) gives zero rows.
        ``id_format="global"``: ids are rows of the layer's whole table, as
        V4.1's model code and vLLM pass them; each column of this shard must
        be -1 or inside its head's global rows.  ``dequantize=False``: the
        rows as stored, ``(weights uint8 [T, heads, head_dim], scales uint8
        [T, heads, head_dim/block])`` (half the output bytes; for a GPU
        that dequantises after the copy; ``out`` a pair of such tensors)."""
        if id_format not in ID_FORMATS:
            raise ValueError(f"id_format must be one of {ID_FORMATS}, got {id_format!r}")
        # one lock round trip in and one out: a decode step's lookup is a few us
        self._enter_lookup()
        started, rows = time.perf_counter(), -1  # -1: failed, not counted
        try:
            ids = check_hash_ids(hash_ids, self._n_cols)
            shape = (ids.shape[0], *self._row_shape)
            if not dequantize:
                result, bits = _packed_out(out, shape, self.spec.block)
            elif out is not None:
                result, bits = bf16_out(out, shape)
            else:
                result, bits = self._outputs.take(shape)
            if shape[0]:
                self._gather(ids, bits, id_format == "global")
            rows = shape[0] * shape[1]
            return result
        finally:
            self._leave_lookup(rows, time.perf_counter() - started)

    def _gather(self, ids: np.ndarray, bits, global_ids: bool) -> None:
        """The kernel over this shard's cached geometry, on this table's
        persistent workers when it looks up with several threads."""
        count, first, value = native.run_geometry_lookup(
            self._geometry, ids, self.shard.head_start, global_ids, bits, self.lookup_threads,
            self._cpu_array, self._lookup_workers())
        if count:
            t, h = divmod(first, self.shard.num_heads)
            base = self.id_base("global") if global_ids else None
            raise LookupIdError(bad_id_text(value, t, self.shard.head_start + h,
                                             int(self._bucket_sizes[h]), base, h, count))

    @property
    def lookup_cpus(self) -> tuple[int, ...]:
        return self._lookup_cpus

    @lookup_cpus.setter
    def lookup_cpus(self, cpus) -> None:
        self._lookup_cpus = tuple(cpus)
        self._cpu_array = np.asarray(self._lookup_cpus, dtype=np.int32) if cpus else None
        self._drop_workers()  # pinned to the old CPUs

    @property
    def lookup_threads(self) -> int:
        return self._lookup_threads

    @lookup_threads.setter
    def lookup_threads(self, threads: int) -> None:
        self._lookup_threads = max(1, int(threads))
        self._drop_workers()

    def _lookup_workers(self) -> native.Workers | None:
        """This table's lookup threads (None for one thread: the caller's own),
        made once, pinned to the rows' node; a forked child makes its own."""
        if self._lookup_threads < 2:
            return None
        with self._idle:
            if self._workers is None or not self._workers.usable:
                self._workers = native.Workers(self._lookup_threads, self._lookup_cpus)
            return self._workers

    def _drop_workers(self) -> None:
        """Stop this table's threads (a forked child's copy has none to stop)."""
        workers = getattr(self, "_workers", None)
        self._workers = None
        if workers is not None and workers.usable:
            workers.close()

    def id_base(self, id_format: str) -> np.ndarray | None:
        """Each shard head's first global row (None for bucket ids)."""
        return id_base(self.spec, self.layer_id, self.shard.head_start, self.shard.head_end,
                       id_format)

    def device_view(self):
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

    def lookup_cuda(self, hash_ids, out=None, *, id_format: str = "bucket",
                    packed: bool = False, max_sms: int | None = None,
                    background: bool = False):
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
            self._leave_lookup(rows, 0.0)

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
            counts = dict(self._counts)
        return TableStats(self.layer_id, self.shard.head_start, self.shard.head_end, self.mode,
                          self.backing_bytes, counts["lookups"], counts["rows"],
                          counts["rows"] * self.spec.row_bytes, counts["seconds"],
                          None if report is None else report.fraction_on_plan,
                          report.bytes_per_node() if report is not None else {})

    def mode_report(self) -> dict:
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
            "identity": _identity_key(self.members[0]),
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
            self._idle.wait_for(lambda: self._active == 0)
        self._drop_workers()  # no lookup runs now: the threads stop here
        self.weights = self.scales = self._device_shard = self._geometry = None
        # device views still alive keep the registration (and the memory)
        # until they are dropped; without any, this unregisters now
        self.registration = None
        _cleanup(self._backing, None)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the table is closed")

    def _enter_lookup(self) -> None:
        """A lookup begins: refused once closed; close() waits until it ends."""
        with self._idle:
            self._check_open()
            self._active += 1

    def _leave_lookup(self, rows: int, seconds: float) -> None:
        """A lookup ended (counted unless it failed: rows -1); wakes a
        waiting close()."""
        with self._idle:
            self._active -= 1
            if rows >= 0:
                self._counts["lookups"] += 1
                self._counts["rows"] += rows
                self._counts["seconds"] += seconds
            if self._closed:
                self._idle.notify_all()

    def __enter__(self) -> SharedEngramTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------- steps --

def _check_shard(spec: EngramSpec, layer_id: int, shard: ShardInfo) -> None:
    sizes = spec.bucket_sizes(layer_id)
    if not 0 <= shard.head_start < shard.head_end <= len(sizes):
        raise TopologyError(f"shard heads [{shard.head_start}, {shard.head_end}) are not heads "
                            f"of layer {layer_id} (0..{len(sizes)})")
    if (shard.row_start, shard.row_end) != (sum(sizes[:shard.head_start]),
                                            sum(sizes[:shard.head_end])):
        raise TopologyError(f"shard rows [{shard.row_start}, {shard.row_end}) are not the rows "
                            "of its heads; build it with shard_heads()")


def _member_node(topo: Topology, device: int | None) -> int:
    """The node this member reads from: its GPU's, else the CPU it runs on."""
    if device is None:
        return current_node(topo)
    node = gpu_node(device)
    if node is not None:
        return node
    if topo.gpus:
        return topo.nearest_node(device)
    return current_node(topo)


def _packed_out(out, shape: tuple[int, ...], block: int):
    """(rows, scales) uint8 CPU tensors for a packed lookup, and their numpy views."""
    import torch

    if out is None:
        out = (torch.empty(shape, dtype=torch.uint8),
               torch.empty((*shape[:2], shape[2] // block), dtype=torch.uint8))
    if not (isinstance(out, tuple) and len(out) == 2 and all(
            torch.is_tensor(t) and t.dtype == torch.uint8 and t.device.type == "cpu"
            for t in out)):
        raise ValueError("out must be a (rows, scales) pair of uint8 CPU tensors for "
                         "dequantize=False")
    return out, (out[0].numpy(), out[1].numpy())


def _identity_key(m: MemberInfo) -> dict:
    """What the sharing group's members have in common (the leader's)."""
    return {"boot_id": m.boot_id.hex(), "uid": m.uid, "directory": m.directory or None,
            "directory_device": None if m.directory_id is None else
            describe_device(m.directory_id),
            "host": m.hostname}


def shard_key(layer_id: int, shard: ShardInfo) -> ShardKey:
    return ShardKey(layer_id, shard.head_start, shard.head_end, shard.row_start, shard.row_end)


def _member_info(grp: Group, topo: Topology, device: int | None, spec: EngramSpec,
                 key: ShardKey, mode: str, directory: str, page_size: int, placement: Any,
                 layout: Layout) -> MemberInfo:
    # huge pages: this member's hugetlbfs mount of that size (a container may
    # mount it elsewhere; the identity check then compares the file systems).
    # None, with the reason, where there is none: a private copy (memfd)
    # needs no mount, so only sharing fails for it.
    problem = ""
    try:
        directory = hugepages.resolve_directory(directory, page_size, DEFAULT_DIRECTORY)
    except StorageError as exc:
        directory, problem = None, str(exc)
    if device is not None:  # before the leader allocates anything
        _check_device(device)
    node = _member_node(topo, device)
    if placement is not None:  # this member's own argument, valid on its own host
        reader = MemberInfo(0, 0, 0, node, device, b"")
        _plan(placement, layout, [reader], topo)
    return MemberInfo(grp.ranks[grp.rank], os.getpid(), os.geteuid(), node,
                      device, spec.fingerprint, key, mode, procfs.boot_id(),
                      directory_id(directory) if directory else None, socket.gethostname(),
                      directory or "", page_size, problem, _placement_text(placement))


def _placement_text(placement: Any) -> str | None:
    """What members compare: the policy string, or a plan's JSON."""
    if placement is None or isinstance(placement, str):
        return placement
    if isinstance(placement, PlacementPlan):
        return json.dumps(placement.to_dict(), sort_keys=True)
    return repr(placement)


def _check_device(device: Any) -> None:
    from ..bindings import cudart as cuda

    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise SpecError(f"register_device must be a CUDA device index >= 0, got {device!r}")
    ok, why = cuda.available()
    if not ok:
        raise errors.CudaUnavailable(f"register_device={device}: {why}; pass "
                                     "register_device=None to keep the table on the CPU")


def _check_agreement(members: list[MemberInfo]) -> None:
    """Every member must ask for the same table: spec, layer and shard, mode."""
    first = members[0]
    odd = [m.rank for m in members if m.fingerprint != first.fingerprint]
    if odd:
        raise SpecMismatchError(f"members {odd} have another Engram spec than the leader; every "
                                "member must build the same EngramSpec")
    for m in members[1:]:
        if m.key != first.key:
            raise SpecMismatchError(f"rank {m.rank} asked for {m.key}, the leader (rank "
                                    f"{first.rank}) for {first.key}; every member of a sharing "
                                    "group must pass the same layer and shard (same TP rank)")
        if m.mode != first.mode:
            raise TopologyError(f"rank {m.rank} asked for mode {m.mode!r}, the leader (rank "
                                f"{first.rank}) for {first.mode!r}; every member must pass the "
                                "same mode")
        if m.placement is not None and m.placement != _leader_placement(first):
            raise SpecMismatchError(f"rank {m.rank} asked for placement {m.placement!r}, the "
                                    f"leader (rank {first.rank}) for "
                                    f"{_leader_placement(first)!r}; every member must pass the "
                                    "same placement, or None to follow the leader")
        if m.page_size != first.page_size:
            raise StorageError(f"rank {m.rank} asked for {hugepages.name_of(m.page_size)} "
                               f"pages, the leader (rank {first.rank}) for "
                               f"{hugepages.name_of(first.page_size)}; every member must pass "
                               "the same page_size")


def _leader_placement(leader: MemberInfo) -> str:
    return leader.placement or DEFAULT_POLICY


def _identity_difference(members: list[MemberInfo]) -> str:
    """Why these members cannot map one file ('' if they can): the same
    boot (host), user and table directory (device and inode) are needed."""
    first = members[0]
    for m in members:
        if m.directory_problem:
            return f"rank {m.rank}: {m.directory_problem}"
    for m in members[1:]:
        if m.boot_id != first.boot_id:
            return (f"rank {m.rank} runs on another host (boot id differs; host "
                    f"{m.hostname!r} vs {first.hostname!r})")
        if m.uid != first.uid:
            return f"rank {m.rank} runs as uid {m.uid}, the leader as uid {first.uid}"
        if m.directory_id != first.directory_id:
            return (f"rank {m.rank} has another {m.directory} ({describe_device(m.directory_id)}"
                    f" vs {describe_device(first.directory_id)})")
    return ""


def _decide(mode: str, members: list[MemberInfo], layout: Layout,
            directory: str) -> tuple[str, str]:
    """Leader: which mode really runs, and why (or why not)."""
    _check_agreement(members)
    if mode == "independent":
        return "independent", ""
    reason, error = "", StorageError
    if len(members) < 2:
        reason = "the sharing group has one member"
    else:
        reason = _identity_difference(members)
        if not reason:
            try:
                check_directory_room(directory, layout)
            except StorageError as exc:
                reason, error = str(exc), type(exc)
    if not reason:
        return "dp_shared", ""
    if mode == "dp_shared":
        raise error(f"dp_shared requested but {reason}")
    here = sum(m.boot_id == members[0].boot_id for m in members)
    what = "the table" if len(members) == 1 else f"{here} independent copies (the fallback)"
    if hugepages.is_huge(layout.page_size):
        hugepages.check_pool(here * layout.file_size, layout.page_size, what=what)
    else:
        check_memory(here * layout.file_size, what=what)
    return "independent", reason


def _plan(placement, layout: Layout, members: list[MemberInfo],
          topology: Topology) -> PlacementPlan | None:
    if isinstance(placement, PlacementPlan):
        return placement
    if placement is not None and not isinstance(placement, str):
        raise PlacementError(f"placement must be a policy string (e.g. 'gpu-local', 'node:0', "
                             f"'interleave') or a PlacementPlan, got {type(placement).__name__} "
                             f"{placement!r}")
    policy = placement or DEFAULT_POLICY
    readers = tuple(m.node for m in members)
    regions = [Region(r.name, r.offset, r.length, readers) for r in layout.regions]
    return plan_placement(policy, regions, topology)


def _weights_range(plan: PlacementPlan | None):
    """The plan's range for the weights region (None without a plan)."""
    return next((r for r in plan.ranges if r.name == "weights"), None) if plan else None


def _bound_nodes(plan: PlacementPlan | None) -> tuple[int, ...] | None:
    """The nodes the weights are bound (or preferred) to; None when their
    pages may be on any node (interleave, first touch, no plan)."""
    weights = _weights_range(plan)
    if weights is None or weights.mode not in ("bind", "preferred"):
        return None
    return weights.nodes


def _reader_cpus(plan: PlacementPlan | None, topology: Topology) -> tuple[int, ...]:
    """CPUs of the node the weights are bound to: lookup threads run there so
    their reads stay local.  Empty (no pinning) for interleave or no plan."""
    weights = _weights_range(plan)
    if weights is None or topology.simulated or weights.mode != "bind" \
            or len(weights.nodes) != 1:
        return ()
    allowed = os.sched_getaffinity(0)
    return tuple(c for c in topology.node(weights.nodes[0]).cpus if c in allowed)


def _resolve(checkpoint: Any, spec: EngramSpec, layer_id: int,
             names: TensorNames | None) -> CheckpointPlan | None:
    return None if checkpoint is None else resolve_checkpoint(checkpoint, spec, layer_id, names)


def _leader_create(state: dict, layout, fingerprint, directory, placement, members, topology,
                   key: ShardKey, threads: int) -> tuple[str, PlacementPlan | None, bool]:
    plan = _plan(placement, layout, members, topology)
    backing = BackingFile.create(layout, fingerprint, directory=directory, placement=plan,
                                 topology=topology, key=key, threads=threads)
    state["backing"] = backing
    state["report"] = verify(backing.mapping, plan) if plan is not None else None
    return backing.path, plan, threads > 1


def _member_map(state: dict, leader: bool, path: str, directory: str, spec: EngramSpec,
                layout: Layout, key: ShardKey, device: int | None, writable: bool) -> None:
    if not leader:
        # by basename in our own directory: a container may mount the tmpfs elsewhere
        mine = os.path.join(directory, os.path.basename(path))
        state["backing"] = _peer_attach(mine, spec, layout, key, writable)
    if device is not None:
        state["registration"] = _register(state["backing"], device)


def _peer_attach(path: str, spec: EngramSpec, layout: Layout, key: ShardKey,
                 writable: bool = False) -> BackingFile:
    # writable only for a member that loads a part (sealed once loaded)
    backing = BackingFile.attach(path, fingerprint=spec.fingerprint, file_size=layout.file_size,
                                 key=key, writable=writable, layout_for=lambda page: layout)
    # map the pages now (cheap, no copy) so reads do not fault one by one
    native.madvise(backing.mapping, native.MADV_POPULATE_READ)
    return backing


def _register(backing: BackingFile, device: int):
    from ..bindings import cudart as cuda

    # peers map the table read-only; CUDA must be told, or pinning it fails
    reg = cuda.register(backing.mapping.address, backing.mapping.length, device,
                        read_only=not backing.owner)
    return cuda.RegistrationLease(reg, backing.mapping.keepalive())


def _load(backing: BackingFile, spec, layer_id, shard, checkpoint, names, progress,
          parts: list[tuple[int, int]], member: int, threads: int, cpus: tuple[int, ...],
          timeout_s: float) -> None:
    """This member's part of the load (bumping its progress slot as it
    goes), then the wait for every loader; the leader then marks READY.
    Any error marks the table FAILED, which ends the others' waits."""
    loaders = loaders_of(parts)
    slot = {m: k for k, m in enumerate(loaders)}
    total = shard.num_rows * spec.row_bytes

    def report() -> None:
        _step("load-progress")
        if progress is not None:
            progress(bytes_done(backing, range(len(loaders))), total)
    if member in slot:
        load_part(backing, spec, layer_id, shard, checkpoint, names, parts[member],
                  slot[member], threads, cpus, report)
    wait_for_parts(backing, range(len(loaders)), timeout_s)
    if member == 0:
        backing.mark_ready()


def _default_load_threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0))))


def _raise_unless(outcome: Outcome) -> None:
    if not outcome.ok:
        raise (_error_class(outcome.error_type) or errors.MemberFailure).rebuild(
            outcome.message, outcome.fields)


def _log_progress(layer_id: int) -> Progress:
    last = [0]

    def report(done: int, total: int) -> None:
        if done == total or done - last[0] >= 1 << 30:
            last[0] = done
            log.info("Engram layer %d: loaded %.2f of %.2f GiB", layer_id, done / 2**30,
                     total / 2**30)
    return report


def _cleanup(backing: BackingFile | None, lease) -> None:
    """A failed create: unregister (no device view exists yet), unmap."""
    if lease is not None:
        lease.release()
    if backing is not None:
        backing.close()


__all__ = ["SharedEngramTable", "SpecMismatchError", "table_layout"]
