"""The create protocol: how a sharing group turns one ``CreateRequest`` per
member into one table file that every member maps (docs/design.md, "Order
of operations").  Each step is a named function that returns what it
produces; the collective around it (``every`` or ``lead``) makes every
member end a failed step the same way, and whatever a failed create made
(the file, the registration) is released.

    join    every member: who it is, what it asks for (MemberInfo)
    decide  leader: the checkpoint resolved, the mode that really runs
    create  leader: plan, check, create, size, map, no THP, bind, populate, verify;
            on 4 KiB pages a memfd, handed over at the leader's socket
    map     every member: the leader's memfd from its socket (4 KiB pages) or
            its file by basename (huge pages); map it, register it; hand it
            over at a socket of its own from now on
    unlink  leader: a file's path goes (every member holds the mapping)
    load    the loaders: their parts of the checkpoint; the leader marks READY
    ready   every member: acknowledged, so all end the same way

A memfd's holders each hand it over for as long as they hold it (a late
process attaches from any of them: ``late_descriptor``); it is freed with
the last holder's mapping, so nothing can be left behind.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from ..bindings import native
from ..checkpoints.checkpoint import CheckpointPlan, Progress
from ..checkpoints.familyreaders import reader_of
from ..checkpoints.plecheckpoint import PLECheckpointPlan
from ..errors import StorageError
from ..groups.group import Group, SingleProcessGroup
from ..groups.identity import HostIdentity
from ..groups.steps import (
    attempt,
    every,
    lead,
    raise_failures,
    raise_unless,
    step_hook,
    unless_failed,
)
from ..host import hugepages
from ..host.topology import Topology
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..store import fdhandover
from ..store.fileformat import STATE_READY, ShardKey
from ..store.placement import PlacementPlan, PlacementRange, PlacementReport, verify
from ..store.serviceclient import TableRequest
from ..store.storage import BackingFile
from .loading import bytes_done, load_part, load_parts, loaders_of, wait_for_parts
from .membership import MemberInfo, decide, member_info, plan_for
from .request import CreateRequest, shard_key, table_layout

log = logging.getLogger(__name__)
AnyPlan = CheckpointPlan | PLECheckpointPlan

# The last step is a short all-gather that every member reaches at once
# (after the load): bounded by this, so a member lost there costs little.
ACK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Built:
    """Everything a table is made of, as the protocol leaves it."""

    backing: BackingFile
    mode: str  # the mode that runs: dp_shared or independent
    fallback_reason: str  # why auto did not share ("" when it did, or was not asked to)
    members: list[MemberInfo]
    leader: bool
    plan: PlacementPlan | None
    report: PlacementReport | None
    registration: Any  # a cudart.RegistrationLease, or None
    lookup_cpus: tuple[int, ...]
    phases: dict[str, float]  # startup seconds: checks, create, populate, map, register, load


def attached(backing: BackingFile, mode: str, fingerprint: bytes, key: ShardKey, node: int,
             registration: Any, phases: dict[str, float]) -> Built:
    """What a table attached outside a group is made of: a READY file this
    process (on ``node``) maps read-only, alone."""
    me = MemberInfo(0, os.getpid(), node, None, fingerprint, key, "attach",
                    HostIdentity.here(None))
    return Built(backing, mode, "", [me], False, None, None, registration, (), phases)


def attach_backing(spec: TableFamily, layer_id: int, shard: ShardInfo, mode: str, node: int,
                   started: float, *, path: str | None = None, fd: int | None = None,
                   owner_uid: int | None = None, peers: str | None = None,
                   register_device: int | None = None) -> Built:
    """A READY table handed over outside a group (by ``path`` or ``fd``),
    mapped read-only after a peer's checks; with ``peers`` (a 4 KiB
    dp_shared table's hand-over directory) held and handed over in turn
    until close, so the table lives while any holder does; registered for
    ``register_device``.  Whatever it made is released if it fails."""
    key = shard_key(layer_id, shard)
    backing = BackingFile.attach(path, fd=fd, fingerprint=spec.fingerprint, key=key,
                                 owner_uid=owner_uid,
                                 layout_for=lambda page: table_layout(spec, shard, page))
    registration = None
    try:
        if backing.state != STATE_READY:
            raise StorageError(f"table {backing.path} is not READY (its creator has not "
                               "finished loading it); attach after create() returned")
        if peers is not None:
            backing.hand_over(peers)
        phases = {"attach": time.perf_counter() - started}
        if register_device is not None:
            mark = time.perf_counter()
            registration = register(backing, register_device)
            phases["register"] = time.perf_counter() - mark
        return attached(backing, mode, spec.fingerprint, key, node, registration, phases)
    except BaseException:
        if registration is not None:
            registration.release()
        backing.close()  # a failed attach keeps no descriptor
        raise


def release(built: Built) -> None:
    """An attached table that could not be made: unregistered, unmapped."""
    if built.registration is not None:
        built.registration.release()
    built.backing.close()


class _Held:
    """What this member has made so far, released if the create fails."""

    def __init__(self) -> None:
        self.backing: BackingFile | None = None
        self.registration: Any = None
        self.report: PlacementReport | None = None
        self.phases: dict[str, float] = {}

    def mapped(self) -> BackingFile:
        if self.backing is None:  # the map step ran before any use
            raise RuntimeError("the table file is not mapped yet")
        return self.backing

    def release(self) -> None:
        """A failed create: unregister (no device view exists yet), unmap."""
        if self.registration is not None:
            self.registration.release()
        if self.backing is not None:
            self.backing.close()


def create(grp: Group, req: CreateRequest) -> Built:
    """Run the protocol in this member; every member returns, or every
    member raises the same class naming every failing member."""
    started = time.perf_counter()
    me, members = join(grp, req)
    directory = me.directory  # this member's (a hugetlbfs mount for huge pages)
    checkpoint, mode, reason = decide_mode(grp, req, members, directory)
    checks = time.perf_counter() - started
    if mode == "independent":
        if reason and grp.size > 1:
            log.warning("Engram layer %d: sharing falls back to independent copies: %s",
                        req.layer_id, reason)
            if grp.rank != 0:  # another host may keep the checkpoint elsewhere
                checkpoint = resolve(req)
        # a private copy needs no path: an anonymous memfd, never in /dev/shm
        grp, members, directory, req = SingleProcessGroup(), [me], None, req.private()
    built = share(grp, req, members, directory, checkpoint)
    return replace(built, mode=mode, fallback_reason=reason,
                   phases={"checks": checks, **built.phases})


def join(grp: Group, req: CreateRequest) -> tuple[MemberInfo, list[MemberInfo]]:
    """Every member's MemberInfo, in group order (this member's first)."""
    me, joined = attempt(lambda: member_info(grp, req))
    _, outcomes = every(grp, "join", lambda: unless_failed(joined, me))     # everyone here
    raise_failures(outcomes, grp.ranks, "join")
    return me, [o.value for o in outcomes]


def decide_mode(grp: Group, req: CreateRequest, members: list[MemberInfo],
                directory: str | None) -> tuple[AnyPlan | None, str, str]:
    """The leader resolves the whole checkpoint (files, tensors, offsets, the
    spec) before anything is decided or allocated: a wrong tensor fails in a
    second, not after a populate; every loader reads that plan.  Then the
    mode that runs, and why."""
    checkpoint, mode, reason = lead(grp, "decide", lambda: (
        resolve(req), *decide(req.mode, members, req.layout, directory)))
    return checkpoint, mode, reason


def share(grp: Group, req: CreateRequest, members: list[MemberInfo], directory: str | None,
          checkpoint: AnyPlan | None) -> Built:
    """The steps from create to ready, for a group that shares one file."""
    leader = grp.rank == 0
    held = _Held()
    try:
        where, plan, cooperative = lead(grp, "create", lambda: create_file(
            held, req, members, directory))
        mark = time.perf_counter()
        cpus = reader_cpus(plan, req.topology)
        # who loads which rows: the members on the rows' node(s), else the
        # leader (the leader's request decides whether loading is shared)
        parts = load_parts(req.shard.num_rows, [m.node for m in members], _bound_nodes(plan),
                           cooperative and checkpoint is not None)
        part = parts[grp.rank]
        _, outcomes = every(grp, "map", lambda: map_file(
            held, leader, where, directory, req, writable=part[1] > part[0]))
        raise_failures(outcomes, grp.ranks, "map")
        unlink(held, leader)
        held.phases["map"] = time.perf_counter() - mark - held.phases.get("register", 0.0)
        mark = time.perf_counter()
        step_hook("before-load")
        _, loaded = attempt(lambda: load(
            held.mapped(), req, checkpoint, (req.options.progress or _log_progress(req.layer_id))
            if leader else None, parts, grp.rank, cpus))
        step_hook("after-load")
        with grp.bounded(min(req.options.timeout_s, ACK_TIMEOUT_S)):
            _, outcomes = every(grp, "ready", lambda: raise_unless(loaded))
        raise_failures(outcomes, grp.ranks, "ready")
        held.phases["load"] = time.perf_counter() - mark
    except BaseException:
        held.release()
        raise
    backing = held.mapped()
    if checkpoint is not None and backing.mapping.writable:
        backing.seal()  # loaded: read-only from now on, in every member
    return Built(backing, "dp_shared" if grp.size > 1 else "independent", "", list(members),
                 leader, plan, held.report, held.registration, cpus, dict(held.phases))


def handed_over(req: CreateRequest, directory: str | None) -> bool:
    """Whether a group's table is a memfd its members hand over (4 KiB
    pages: ``directory`` is then the hand-over sockets' root) rather than a
    file in ``directory`` (huge pages: a hugetlbfs mount)."""
    return directory is not None and not hugepages.is_huge(req.page_size)


def create_file(held: _Held, req: CreateRequest, members: list[MemberInfo],
                directory: str | None) -> tuple[str, PlacementPlan | None, bool]:
    """Leader: the table planned, created, sized, mapped, bound, populated,
    verified; where the members get it (its hand-over socket, or its path),
    the plan and whether loading is cooperative."""
    plan = plan_for(req.options.placement, req.layout, members, req.topology)
    memfd = handed_over(req, directory)
    backing = BackingFile.create(req.layout, req.spec.fingerprint,
                                 directory=None if memfd else directory,
                                 placement=plan, topology=req.topology, key=req.key,
                                 threads=req.load_threads, phases=held.phases)
    held.backing = backing
    held.report = verify(backing.mapping, plan) if plan is not None else None
    if memfd:
        assert directory is not None  # (handed_over)
        made = fdhandover.new_directory(directory)
        try:
            return backing.hand_over(made), plan, req.shared_load
        except BaseException:
            fdhandover.sweep(made)  # (empty: no holder got to it)
            raise
    return backing.path, plan, req.shared_load


def map_file(held: _Held, leader: bool, where: str, directory: str | None,
             req: CreateRequest, writable: bool) -> None:
    """Every member maps the leader's table and registers it for its GPU; a
    memfd's members hand it over too from now on."""
    if not leader and handed_over(req, directory):
        held.backing = peer_receive(where, req, writable)
        held.backing.hand_over(os.path.dirname(where))
    elif not leader:
        # by basename in our own directory: a container may mount the tmpfs elsewhere
        mine = os.path.join(directory or "", os.path.basename(where))
        held.backing = peer_attach(mine, req, writable)
    if req.options.register_device is not None:
        started = time.perf_counter()
        held.registration = register(held.mapped(), req.options.register_device)
        held.phases["register"] = time.perf_counter() - started


def unlink(held: _Held, leader: bool) -> None:
    """All members mapped the file, so its path can go."""
    step_hook("before-unlink")
    if leader:
        held.mapped().unlink()
    step_hook("after-unlink")


def peer_attach(path: str | None, req: CreateRequest, writable: bool = False,
                fd: int | None = None, owner_uid: int | None = None) -> BackingFile:
    """A peer's mapping of the leader's file (by ``path``, or a descriptor
    of it), after the checks a peer makes; writable only for a member that
    loads a part (sealed once loaded)."""
    layout = req.layout
    backing = BackingFile.attach(path, fd=fd, fingerprint=req.spec.fingerprint,
                                 file_size=layout.file_size, key=req.key, writable=writable,
                                 layout_for=lambda _page: layout, owner_uid=owner_uid)
    # map the pages now (cheap, no copy) so reads do not fault one by one
    native.madvise(backing.mapping, native.MADV_POPULATE_READ)
    return backing


def peer_receive(socket_path: str, req: CreateRequest, writable: bool) -> BackingFile:
    """A member's mapping of the leader's memfd, received at the leader's
    hand-over socket, after the checks a peer makes."""
    fd, owner = fdhandover.receive(os.path.dirname(socket_path), table_request(req.spec, req.key,
                                   req.page_size), req.options.timeout_s, only=socket_path)
    try:
        return peer_attach(None, req, writable, fd=fd, owner_uid=owner)
    finally:
        os.close(fd)  # the backing holds its own duplicate


def table_request(spec: TableFamily, key: ShardKey, page_size: int) -> TableRequest:
    """What a holder is asked for: the table service's request for it."""
    return TableRequest(spec.fingerprint, key, page_size)


def late_descriptor(spec: TableFamily, layer_id: int, shard: ShardInfo, page_size: int,
                    directory: str, timeout_s: float) -> tuple[int, int]:
    """(a descriptor of a READY table its group's members hand over at
    ``directory``, the holder's uid), for a process that was not in the
    create: from any holder still alive."""
    return fdhandover.receive(directory, table_request(spec, shard_key(layer_id, shard),
                                                      page_size), timeout_s)


def register(backing: BackingFile, device: int) -> Any:
    """Pin the mapping for zero-copy reads by ``device``; the lease keeps
    the memory alive while device views exist."""
    from ..bindings import cudart

    # peers map the table read-only; CUDA must be told, or pinning it fails
    reg = cudart.register(backing.mapping.address, backing.mapping.length, device,
                          read_only=not backing.owner)
    return cudart.RegistrationLease(reg, backing.mapping.keepalive())


def load(backing: BackingFile, req: CreateRequest, checkpoint: AnyPlan | None,
         progress: Progress | None, parts: list[tuple[int, int]], member: int,
         cpus: tuple[int, ...]) -> None:
    """This member's part of the load (bumping its progress slot as it
    goes), then the wait for every loader; the leader then marks READY.
    Any error marks the table FAILED, which ends the others' waits."""
    loaders = loaders_of(parts)
    slot = {m: k for k, m in enumerate(loaders)}
    total = req.shard.num_rows * req.spec.row_bytes

    def group_progress() -> None:
        if progress is not None:
            progress(bytes_done(backing, range(len(loaders))), total)

    def report() -> None:
        step_hook("load-progress")
        group_progress()
    if member in slot:
        load_part(backing, req.spec, req.layer_id, req.shard, checkpoint, req.options.names,
                  parts[member], slot[member], req.load_threads, cpus, report)
    # the group's progress (every loader's slot), also while the others finish
    wait_for_parts(backing, range(len(loaders)), req.stall_timeout_s, group_progress)
    group_progress()
    if member == 0:
        backing.mark_ready()


def resolve(req: CreateRequest) -> AnyPlan | None:
    if req.checkpoint is None:
        return None
    return reader_of(req.spec).resolve(req.checkpoint, req.spec, req.layer_id,
                                       req.options.names)


def _weights_range(plan: PlacementPlan | None) -> PlacementRange | None:
    """The plan's range for the weights region (None without a plan)."""
    return next((r for r in plan.ranges if r.name == "weights"), None) if plan else None


def _bound_nodes(plan: PlacementPlan | None) -> tuple[int, ...] | None:
    """The nodes the weights are bound (or preferred) to; None when their
    pages may be on any node (interleave, first touch, no plan)."""
    weights = _weights_range(plan)
    if weights is None or weights.memory_policy not in ("bind", "preferred"):
        return None
    return weights.nodes


def reader_cpus(plan: PlacementPlan | None, topology: Topology) -> tuple[int, ...]:
    """CPUs of the node the weights are bound to: lookup threads run there so
    their reads stay local.  Empty (no pinning) for interleave or no plan."""
    weights = _weights_range(plan)
    if weights is None or topology.simulated or weights.memory_policy != "bind" \
            or len(weights.nodes) != 1:
        return ()
    allowed = os.sched_getaffinity(0)
    return tuple(c for c in topology.node(weights.nodes[0]).cpus if c in allowed)


def _log_progress(layer_id: int) -> Progress:
    last = [0]

    def report(done: int, total: int) -> None:
        if done == total or done - last[0] >= 1 << 30:
            last[0] = done
            log.info("layer %d: loaded %.2f of %.2f GiB", layer_id, done / 2**30,
                     total / 2**30)
    return report
