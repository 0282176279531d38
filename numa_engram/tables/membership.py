"""Who the members of a sharing group are and whether they agree: each
member's ``MemberInfo`` (the join step), the agreement every member's
request must reach with the leader's, whether the members can map one file
(same host, user, and hand-over root or hugetlbfs mount), and the
leader's decision of the mode that really runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..bindings import native
from ..errors import PlacementError, SpecError, SpecMismatchError, StorageError, TopologyError
from ..groups.group import Group
from ..groups.identity import NOWHERE, HostIdentity
from ..host import hugepages
from ..host.accounting import check_memory
from ..host.topology import Topology, current_node, gpu_node
from ..literals import DEFAULT_DIRECTORY
from ..store import fdhandover
from ..store.directories import check_directory_room
from ..store.fileformat import Layout, ShardKey
from ..store.placement import PlacementPlan, Region, plan_placement
from .request import DEFAULT_POLICY, CreateRequest


@dataclass(frozen=True)
class MemberInfo:
    rank: int  # world rank
    pid: int
    node: int
    device: int | None
    fingerprint: bytes
    key: ShardKey = ShardKey()
    mode: str = "auto"
    host: HostIdentity = NOWHERE  # where it is (the identity sharing_groups also gathers)
    # what it shares with the others (meeting_directory; None: none usable)
    directory: str | None = None
    page_size: int = native.PAGE_SIZE
    directory_problem: str = ""  # why this member has no directory for the table
    placement: str | None = None  # as this member asked for it (None: follow the leader)


def identity_key(m: MemberInfo) -> dict:
    """What the sharing group's members have in common (the leader's)."""
    return m.host.report(m.directory)


def member_info(grp: Group, req: CreateRequest) -> MemberInfo:
    """Who this member is and what it asks for (the join step's value); a
    member whose host cannot serve the request fails here, in the join step,
    so every member fails with it."""
    # huge pages: this member's hugetlbfs mount of that size (a container may
    # mount it elsewhere; the identity check then compares the file systems).
    # None, with the reason, where there is none: a private copy (memfd)
    # needs no mount, so only sharing fails for it.
    problem = ""
    directory: str | None
    try:
        directory = meeting_directory(req)
    except StorageError as exc:
        directory, problem = None, str(exc)
    device = req.options.register_device
    if device is not None:  # before the leader allocates anything
        check_device(device)
    node = member_node(req.topology, device)
    if req.options.placement is not None:  # this member's own argument, valid on its own host
        reader = MemberInfo(0, 0, node, device, b"")
        plan_for(req.options.placement, req.layout, [reader], req.topology)
    return MemberInfo(grp.ranks[grp.rank], os.getpid(), node, device, req.spec.fingerprint,
                      req.key, req.mode, HostIdentity.here(directory), directory, req.page_size,
                      problem, placement_text(req.options.placement))


def meeting_directory(req: CreateRequest) -> str | None:
    """The directory this member shares with the others, whose identity the
    join compares: on 4 KiB pages the root of the table's hand-over sockets
    (the table is a memfd, never a file: /dev/shm's size does not matter),
    on huge pages the hugetlbfs mount the table file lives in.  None where
    ``directory=None`` asks for a private copy."""
    if req.options.directory is None:
        return None
    if not hugepages.is_huge(req.page_size):
        root = fdhandover.root()
        fdhandover.check_root(root)
        return root
    return hugepages.resolve_directory(req.options.directory, req.page_size, DEFAULT_DIRECTORY)


def placement_text(placement: Any) -> str | None:
    """What members compare: the policy string, or a plan's JSON."""
    if placement is None or isinstance(placement, str):
        return placement
    if isinstance(placement, PlacementPlan):
        return json.dumps(placement.to_dict(), sort_keys=True)
    return repr(placement)


def check_device(device: Any) -> None:
    from ..bindings import cudart as cuda

    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise SpecError(f"register_device must be a CUDA device index >= 0, got {device!r}")
    ok, why = cuda.available()
    if not ok:
        raise errors.CudaUnavailable(f"register_device={device}: {why}; pass "
                                     "register_device=None to keep the table on the CPU")


def check_agreement(members: list[MemberInfo]) -> None:
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
        if m.placement is not None and m.placement != leader_placement(first):
            raise SpecMismatchError(f"rank {m.rank} asked for placement {m.placement!r}, the "
                                    f"leader (rank {first.rank}) for "
                                    f"{leader_placement(first)!r}; every member must pass the "
                                    "same placement, or None to follow the leader")
        if m.page_size != first.page_size:
            raise StorageError(f"rank {m.rank} asked for {hugepages.name_of(m.page_size)} "
                               f"pages, the leader (rank {first.rank}) for "
                               f"{hugepages.name_of(first.page_size)}; every member must pass "
                               "the same page_size")


def leader_placement(leader: MemberInfo) -> str:
    return leader.placement or DEFAULT_POLICY


def identity_difference(members: list[MemberInfo]) -> str:
    """Why these members cannot map one table ('' if they can): the same
    boot (host), user and meeting directory (device and inode) are needed."""
    first = members[0]
    for m in members:
        if m.directory_problem:
            return f"rank {m.rank}: {m.directory_problem}"
    for m in members[1:]:
        why = m.host.difference(first.host, m.directory)
        if why:
            return f"rank {m.rank} {why}"
    return ""


def decide(mode: str, members: list[MemberInfo], layout: Layout,
           directory: str | None) -> tuple[str, str]:
    """Leader: which mode really runs, and why (or why not)."""
    check_agreement(members)
    if mode == "independent":
        return "independent", ""
    reason, error = "", StorageError
    if len(members) < 2:
        reason = "the sharing group has one member"
    else:
        reason = identity_difference(members)
        if not reason and directory is None:
            reason = ("directory=None asks for private memfd copies; leave directory at its "
                      "default to share (huge pages: pass a hugetlbfs mount)")
        elif not reason and directory is not None and hugepages.is_huge(layout.page_size):
            try:  # (a memfd's room is memory: checked before it is created)
                check_directory_room(directory, layout)
            except StorageError as exc:
                reason, error = str(exc), type(exc)
    if not reason:
        return "dp_shared", ""
    if mode == "dp_shared":
        raise error(f"dp_shared requested but {reason}")
    here = sum(m.host.boot_id == members[0].host.boot_id for m in members)
    what = "the table" if len(members) == 1 else f"{here} independent copies (the fallback)"
    if hugepages.is_huge(layout.page_size):
        hugepages.check_pool(here * layout.file_size, layout.page_size, what=what)
    else:
        check_memory(here * layout.file_size, what=what)
    return "independent", reason


def plan_for(placement: Any, layout: Layout, members: list[MemberInfo],
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


def member_node(topo: Topology, device: int | None) -> int:
    """The node this member reads from: its GPU's, else the CPU it runs on."""
    if device is None:
        return current_node(topo)
    node = gpu_node(device)
    if node is not None:
        return node
    if topo.gpus:
        return topo.nearest_node(device)
    return current_node(topo)
