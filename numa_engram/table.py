"""SharedEngramTable: one shard of one Engram layer in host memory, one
physical copy per sharing group.

``create`` is the leader/peer protocol of DESIGN.md section 3, written as
one visible sequence of named steps; every collective is bounded by the
group's timeout, and a failure anywhere ends with the same clear exception
in every member and nothing left in /dev/shm.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors, native
from .checkpoint import DEFAULT_NAMES, Progress, TensorNames, load_rows
from .errors import NumaEngramError, SpecMismatchError, StorageError, TopologyError
from .group import Group, SingleProcessGroup, TorchGroup
from .placement import PlacementPlan, PlacementReport, Region, plan_placement, verify
from .sharding import ShardInfo
from .spec import EngramSpec
from .storage import (
    DEFAULT_DIRECTORY,
    STATE_READY,
    BackingFile,
    Layout,
    check_shmem_thp,
    check_space,
)
from .topology import Topology, current_node, read_pci_numa_node

log = logging.getLogger(__name__)

MODES = ("auto", "dp_shared", "independent")
# Test hook: called with the name of each protocol step (e.g. to kill the
# leader between create and unlink in a failure test).  None in production.
_STEP_HOOK: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _STEP_HOOK is not None:
        _STEP_HOOK(name)


@dataclass(frozen=True)
class MemberInfo:
    rank: int  # world rank
    pid: int
    uid: int
    node: int
    device: int | None
    fingerprint: bytes


@dataclass(frozen=True)
class Outcome:
    """What one member reports after a step: ok, or the error to re-raise."""

    ok: bool
    error_type: str = ""
    message: str = ""
    value: Any = None


def _attempt(fn: Callable[[], Any]) -> tuple[Any, Outcome]:
    try:
        return fn(), Outcome(True)
    except (NumaEngramError, OSError, ValueError) as exc:
        return None, Outcome(False, type(exc).__name__, str(exc))


def _raise_first_failure(outcomes: list[Outcome], step: str) -> None:
    for rank, o in enumerate(outcomes):
        if not o.ok:
            cls = getattr(errors, o.error_type, None)
            if not (isinstance(cls, type) and issubclass(cls, NumaEngramError)):
                cls = StorageError
            raise cls(f"sharing group failed at step '{step}' on member {rank}: {o.message}")


def _as_group(group: Any, timeout_s: float) -> Group:
    if group is None:
        return SingleProcessGroup()
    if isinstance(group, (SingleProcessGroup, TorchGroup)):
        return group
    return TorchGroup(group, timeout_s)  # a torch.distributed ProcessGroup


def table_layout(spec: EngramSpec, shard: ShardInfo) -> Layout:
    return Layout.of([("weights", shard.num_rows * spec.head_dim),
                      ("scales", shard.num_rows * spec.scales_per_row)])


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
        self._device_shard = None
        self._closed = False

    # ------------------------------------------------------------ create --
    @classmethod
    def create(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *, group: Any = None,
               placement: str | PlacementPlan | None = None,
               directory: str = DEFAULT_DIRECTORY, checkpoint: Any = None,
               register_device: int | None = None, timeout_s: float = 300.0,
               mode: str = "auto", topology: Topology | None = None,
               names: TensorNames = DEFAULT_NAMES, progress: Progress | None = None,
               lookup_threads: int = 1) -> SharedEngramTable:
        """Collective over ``group`` (its rank 0 leads; None: a private table).

        mode: ``dp_shared`` (one copy for the group; fails loudly when it
        cannot share), ``independent`` (each member its own copy) or ``auto``
        (shares when the group has > 1 member and the tmpfs has room, else
        falls back to independent with a warning)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_shard(spec, layer_id, shard)
        grp = _as_group(group, timeout_s)
        topo = topology or Topology.detect()
        layout = table_layout(spec, shard)
        me = MemberInfo(grp.ranks[grp.rank], os.getpid(), os.geteuid(),
                        _member_node(topo, register_device), register_device, spec.fingerprint)
        members = grp.all_gather(me, "join")                                      # everyone here
        decision = grp.broadcast(
            _decide(mode, members, layout, directory) if grp.rank == 0 else None, "decide")
        _raise_first_failure([decision], "decide")
        actual, reason = decision.value
        if actual == "independent":
            if reason and grp.size > 1:
                log.warning("Engram layer %d: sharing falls back to independent copies: %s",
                            layer_id, reason)
            # a private copy needs no path: an anonymous memfd, never in /dev/shm
            grp, members, directory = SingleProcessGroup(), [me], None
        args = dict(placement=placement, directory=directory, checkpoint=checkpoint,
                    register_device=register_device, topology=topo, names=names,
                    progress=progress)
        table = cls._share(spec, layer_id, shard, grp, members, layout, **args)
        table.mode, table.requested_mode, table.fallback_reason = actual, mode, reason
        table.lookup_threads = lookup_threads
        table.lookup_cpus = _reader_cpus(table.plan, topo)
        log.info("Engram table: %s", table.mode_report())
        return table

    @classmethod
    def _share(cls, spec, layer_id, shard, grp: Group, members, layout, *, placement, directory,
               checkpoint, register_device, topology, names, progress) -> SharedEngramTable:
        """DESIGN.md section 3, steps 1-10, for a group that shares one file."""
        leader = grp.rank == 0
        plan = _plan(placement, layout, members, topology)
        backing = report = registration = None
        try:
            # steps 1-7 (leader): check, create, size, map, no THP, bind, populate, verify
            if leader:
                created, made = _attempt(lambda: _leader_create(
                    layout, spec.fingerprint, directory, plan, topology))
                backing, report = created if made.ok else (None, None)
                _step("after-create")
            made = grp.broadcast(made if leader else None, "create")
            _raise_first_failure([made], "create")
            path = grp.broadcast(backing.path if leader else None, "path")         # step 8
            if not leader:
                backing, mapped = _attempt(lambda: _peer_attach(path, spec, layout))
            else:
                mapped = Outcome(True)
            if mapped.ok and register_device is not None:
                registration, mapped = _attempt(lambda: _register(backing, register_device))
            _raise_first_failure(grp.all_gather(mapped, "mapped"), "map")          # step 9
            if leader:
                backing.unlink()
                _step("after-unlink")
                _, loaded = _attempt(lambda: _leader_load(backing, spec, layer_id, shard,   # 10
                                                          checkpoint, names, progress))
            loaded = grp.broadcast(loaded if leader else None, "ready")
            _raise_first_failure([loaded], "load")
            if not leader and backing.state != STATE_READY:
                raise StorageError(f"table {path} is not READY after the leader's barrier")
        except BaseException:
            _cleanup(backing, registration)
            raise
        return cls(spec, layer_id, shard, backing, mode="dp_shared" if grp.size > 1 else
                   "independent", requested_mode="", members=list(members), leader=leader,
                   plan=plan, report=report, registration=registration)

    @classmethod
    def attach(cls, spec: EngramSpec, layer_id: int, shard: ShardInfo, *,
               path: str | None = None, fd: int | None = None) -> SharedEngramTable:
        """Map a READY table handed over outside a group (its path before the
        unlink, or an fd passed over a Unix socket), read-only, after the
        same checks a peer makes."""
        _check_shard(spec, layer_id, shard)
        layout = table_layout(spec, shard)
        backing = BackingFile.attach(path, fd=fd, fingerprint=spec.fingerprint,
                                     file_size=layout.file_size)
        if backing.state != STATE_READY:
            backing.close()
            raise StorageError(f"table {backing.path} is not READY (its creator has not "
                               "finished loading it); attach after create() returned")
        me = MemberInfo(0, os.getpid(), os.geteuid(), current_node(Topology.detect()), None,
                        spec.fingerprint)
        return cls(spec, layer_id, shard, backing, mode="attached", requested_mode="attach",
                   members=[me], leader=False, plan=None, report=None)

    # ------------------------------------------------------------ lookup --
    def lookup(self, hash_ids, out=None, *, dedup: bool = False):
        """BF16 ``[T, heads_in_shard, head_dim]`` rows for ``hash_ids
        [T, n_hash_cols]``; DEAD_ID (-1) gives zero rows."""
        from .fp8 import bf16_out

        self._check_open()
        ids = native.check_hash_ids(hash_ids, self.spec.n_hash_cols)
        result, bits = bf16_out(out, (ids.shape[0], self.shard.num_heads, self.spec.head_dim))
        native.gather_dequant(self.weights, self.scales, ids, head_start=self.shard.head_start,
                              bucket_sizes=self._bucket_sizes, out=bits, dedup=dedup,
                              threads=self.lookup_threads, cpus=self.lookup_cpus,
                              block=self.spec.block)
        return result

    def device_view(self):
        """Zero-copy CUDA views of this shard (needs register_device=)."""
        from .cuda import DeviceShard

        self._check_open()
        if self.registration is None:
            raise StorageError("the table is not registered with CUDA; create it with "
                               "register_device=<cuda device index>")
        if self._device_shard is None:
            self._device_shard = DeviceShard(self.weights, self.scales, self.registration.device,
                                             self.shard.head_start, self._bucket_sizes,
                                             self.spec.block)
        return self._device_shard

    def lookup_cuda(self, hash_ids, out=None, *, validate: bool = True):
        """The lookup on the GPU that registered the table: a zero-copy gather
        over PCIe plus dequantisation on the device."""
        return self.device_view().lookup(hash_ids, out=out, validate=validate)

    # ----------------------------------------------------------- reports --
    def placement_report(self, refresh: bool = True) -> PlacementReport | None:
        """Where this member sees the pages (re-measured unless refresh=False)."""
        self._check_open()
        if self.plan is None:
            return None
        if refresh or self._report is None:
            self._report = verify(self._backing.mapping, self.plan)
        return self._report

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
        }

    # ------------------------------------------------------------- close --
    def close(self) -> None:
        """Unregister, unmap (idempotent).  Views handed out stay valid until
        they are dropped."""
        if self._closed:
            return
        self._closed = True
        self.weights = self.scales = self._device_shard = None
        _cleanup(self._backing, self.registration)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the table is closed")

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
    """The node this member reads from: its GPU's (by the PCI bus id CUDA
    reports, so CUDA and PCI order may differ), else the CPU it runs on."""
    if device is None:
        return current_node(topo)
    bus_id = _cuda_bus_id(device)
    if bus_id:
        node = read_pci_numa_node(bus_id)
        if node >= 0:
            return node
    if topo.gpus:
        return topo.nearest_node(device)
    return current_node(topo)


def _cuda_bus_id(device: int) -> str:
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        p = torch.cuda.get_device_properties(device)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except (ImportError, RuntimeError, AttributeError, AssertionError):
        return ""


def _decide(mode: str, members: list[MemberInfo], layout: Layout,
            directory: str) -> Outcome:
    """Leader: which mode really runs, and why (or why not)."""
    fingerprints = {m.fingerprint for m in members}
    if len(fingerprints) > 1:
        odd = [m.rank for m in members if m.fingerprint != members[0].fingerprint]
        return Outcome(False, "SpecMismatchError",
                       f"members {odd} have another Engram spec than the leader; every member "
                       "must build the same EngramSpec")
    if mode == "independent":
        return Outcome(True, value=("independent", ""))
    reason, error_type = "", "StorageError"
    if len(members) < 2:
        reason = "the sharing group has one member"
    else:
        try:
            check_shmem_thp()
            check_space(directory, layout.file_size)
        except StorageError as exc:
            reason, error_type = str(exc), type(exc).__name__
    if not reason:
        return Outcome(True, value=("dp_shared", ""))
    if mode == "dp_shared":
        return Outcome(False, error_type, f"dp_shared requested but {reason}")
    return Outcome(True, value=("independent", reason))


def _plan(placement, layout: Layout, members: list[MemberInfo],
          topology: Topology) -> PlacementPlan | None:
    if isinstance(placement, PlacementPlan):
        return placement
    policy = placement or "gpu-local"
    readers = tuple(m.node for m in members)
    regions = [Region(r.name, r.offset, r.length, readers) for r in layout.regions]
    return plan_placement(policy, regions, topology)


def _reader_cpus(plan: PlacementPlan | None, topology: Topology) -> tuple[int, ...]:
    """CPUs of the node the weights are bound to: lookup threads run there so
    their reads stay local.  Empty (no pinning) for interleave or no plan."""
    if plan is None or topology.simulated:
        return ()
    weights = next((r for r in plan.ranges if r.name == "weights"), None)
    if weights is None or weights.mode != "bind" or len(weights.nodes) != 1:
        return ()
    allowed = os.sched_getaffinity(0)
    return tuple(c for c in topology.node(weights.nodes[0]).cpus if c in allowed)


def _leader_create(layout, fingerprint, directory, plan, topology):
    backing = BackingFile.create(layout, fingerprint, directory=directory, placement=plan,
                                 topology=topology)
    try:
        report = verify(backing.mapping, plan) if plan is not None else None
    except BaseException:
        backing.close()
        raise
    return backing, report


def _peer_attach(path: str, spec: EngramSpec, layout: Layout) -> BackingFile:
    backing = BackingFile.attach(path, fingerprint=spec.fingerprint, file_size=layout.file_size)
    # map the pages now (cheap, no copy) so reads do not fault one by one
    native.madvise(backing.mapping, native.MADV_POPULATE_READ)
    return backing


def _register(backing: BackingFile, device: int):
    from . import cuda

    # peers map the table read-only; CUDA must be told, or pinning it fails
    return cuda.register(backing.mapping.address, backing.mapping.length, device,
                         read_only=not backing.owner)


def _leader_load(backing: BackingFile, spec, layer_id, shard, checkpoint, names, progress):
    if checkpoint is not None:
        w = backing.region("weights").reshape(shard.num_rows, spec.head_dim)
        s = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)
        load_rows(checkpoint, spec, layer_id, shard.row_start, shard.row_end, w, s, names=names,
                  progress=progress or _log_progress(layer_id))
    backing.mark_ready()


def _log_progress(layer_id: int) -> Progress:
    last = [0]

    def report(done: int, total: int) -> None:
        if done == total or done - last[0] >= 1 << 30:
            last[0] = done
            log.info("Engram layer %d: loaded %.2f of %.2f GiB", layer_id, done / 2**30,
                     total / 2**30)
    return report


def _cleanup(backing: BackingFile | None, registration) -> None:
    if registration is not None:
        from . import cuda
        try:
            cuda.unregister(registration)
        except NumaEngramError as exc:
            log.warning("unregistering the table failed: %s", exc)
    if backing is not None:
        backing.close()


__all__ = ["SharedEngramTable", "SpecMismatchError", "table_layout"]
