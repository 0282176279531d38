"""What ``EngramRuntime.from_pretrained`` builds per Engram layer: this
rank's table (made in its sharing group, DP-sharded with its exchange, or
attached from the table service), the groups it is made in, and whether
the service holds every layer for this rank."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError, TopologyError
from ..groups.group import Group, as_group, sharing_groups
from ..literals import PageSize
from ..model.sharding import shard_heads
from ..model.spec import EngramSpec
from ..tables.request import TableOptions
from ..tables.table import SharedEngramTable
from .dpsharded import DPShardedLookup, ShardedHeads
from .modeldir import ModelDirectory
from .tpgather import TPGroup

log = logging.getLogger(__name__)

DEFAULT_SERVICE_SOCKET = "/run/numa-engram/engram.sock"  # the unit file's


@dataclass
class RuntimeLayer:
    """One Engram layer of this rank: its table, and in the DP-sharded mode
    the exchange that completes this TP rank's heads."""

    layer_id: int
    table: SharedEngramTable
    sharded: DPShardedLookup | None
    heads: tuple[int, int]  # [first, end) of this TP rank's heads

    def report(self) -> dict:
        doc: dict[str, Any] = dict(self.table.mode_report())
        if self.sharded is not None:
            doc.update(self.sharded.mode_report())
        doc["tp_heads"] = list(self.heads)
        return doc


def world_ranks(group: Any) -> tuple[int, ...]:
    """World ranks of a Group, a GroupCoordinator (``ranks``) or a ProcessGroup."""
    if hasattr(group, "ranks"):
        ranks = group.ranks
        return tuple(int(r) for r in (ranks() if callable(ranks) else ranks))
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def runtime_groups(sharing: str, world_group: Any, edp_group: Any, tp_rank: int,
                   device: int | None, directory: str,
                   timeout_s: float) -> tuple[Group | None, Group | None]:
    """(the sharing group of the tables, the EDP group of the exchange)."""
    import torch.distributed as dist

    if sharing == "independent" or not dist.is_initialized():
        return None, None
    if sharing == "dp_sharded":
        if edp_group is not None:
            return None, as_group(edp_group, timeout_s)
        return None, sharing_groups(world_group, tp_rank=tp_rank, device=device,
                                    directory=directory, timeout_s=timeout_s)
    within = None if edp_group is None else [world_ranks(edp_group)]
    return sharing_groups(world_group, tp_rank=tp_rank, device=device, directory=directory,
                          timeout_s=timeout_s, within=within), None


def make_layer(model: ModelDirectory, layer: int, tp: TPGroup, group: Group | None,
               edp: Group | None, sharing: str, max_tokens: int, checkpoint: Any,
               options: TableOptions) -> RuntimeLayer:
    spec: EngramSpec = model.spec
    mine = shard_heads(spec.bucket_sizes(layer), tp.size, tp.rank)
    heads = (mine.head_start, mine.head_end)
    if edp is not None:  # this member's slice of the TP rank's heads, a private table
        sharded_heads = ShardedHeads.of(spec, layer, tp.size, edp.size, tp.rank)
        table = SharedEngramTable.create(spec, layer, sharded_heads.members[edp.rank],
                                         mode="independent", checkpoint=checkpoint,
                                         options=options)
        try:
            exchange = DPShardedLookup(table, sharded_heads, edp.rank, group=edp,
                                       max_tokens=max_tokens)
        except BaseException:
            table.close()
            raise
        return RuntimeLayer(layer, table, exchange, heads)
    mode = "auto" if sharing in ("auto", "dp_sharded") else sharing
    table = SharedEngramTable.create(
        spec, layer, mine, group=group, mode=mode,  # type: ignore[arg-type]
        checkpoint=checkpoint, options=options)
    return RuntimeLayer(layer, table, None, heads)


def attached_layer(model: ModelDirectory, layer: int, tp: TPGroup, socket_path: str,
                   page_size: PageSize | int, device: int | None) -> RuntimeLayer:
    """This TP rank's shard of the layer, from the table service."""
    mine = shard_heads(model.spec.bucket_sizes(layer), tp.size, tp.rank)
    table = SharedEngramTable.attach(model.spec, layer, mine, service=socket_path,
                                     page_size=page_size, register_device=device)
    return RuntimeLayer(layer, table, None, (mine.head_start, mine.head_end))


def service_path(service: str | None, sharing: str, model: ModelDirectory, tp: TPGroup,
                 page_size: PageSize | int, world_group: Any,
                 timeout_s: float) -> str | None:
    """The socket to attach through, or None to build the tables here.
    ``auto`` asks the service whether it holds this rank's shard of every
    layer (waiting while it loads them); the ranks then agree (all attach,
    or all build: building is collective)."""
    if service is None:
        return None
    if sharing == "dp_sharded":
        raise TopologyError("the DP-sharded mode holds per-member head slices, which a table "
                            "service does not: use sharing='dp_shared' with service=")
    if service != "auto":
        return service
    path = os.environ.get("NUMA_ENGRAM_SOCKET", DEFAULT_SERVICE_SOCKET)
    try:
        answer: bool | str = service_holds(path, model, tp, page_size, timeout_s)
    except StorageError as exc:  # every rank learns it, none waits in a collective alone
        answer = str(exc)
    import torch.distributed as dist

    answers = as_group(world_group).all_gather(answer, "service") if dist.is_initialized() \
        else [answer]
    problems = [a for a in answers if isinstance(a, str)]
    if problems:
        raise StorageError(problems[0])
    usable = all(answers)
    if not usable:
        log.info("Engram runtime: no usable table service at %s; building the tables", path)
    return path if usable else None


def service_holds(path: str, model: ModelDirectory, tp: TPGroup, page_size: PageSize | int,
                  timeout_s: float) -> bool:
    """Whether the service at ``path`` holds this rank's shard of every
    layer, ready: a service still loading some (a sidecar starting beside
    the engine) is waited for, up to ``timeout_s``, its progress logged; one
    that lacks a shard, failed one, or is not trusted is not used."""
    from ..host.hugepages import parse_page_size
    from ..store import serviceclient

    if not os.path.exists(path):
        return False
    wanted = {(layer, (s := shard_heads(model.spec.bucket_sizes(layer), tp.size, tp.rank))
               .head_start, s.head_end) for layer in model.spec.layer_ids}
    deadline, said = time.monotonic() + timeout_s, 0.0
    while True:
        try:
            doc = serviceclient.status(path, trust=serviceclient.ServiceTrust.of())
        except StorageError as exc:
            log.warning("Engram runtime: not using the table service at %s: %s", path, exc)
            return False
        if doc.get("spec_fingerprint") != model.spec.fingerprint.hex() or \
                doc.get("page_size") != parse_page_size(page_size):
            return False
        mine = {(t["layer"], *t["heads"]): t for t in doc.get("tables", [])
                if (t["layer"], *t["heads"]) in wanted}
        if len(mine) < len(wanted) or any(t["state"] == "failed" for t in mine.values()):
            return False
        loading = [t for t in mine.values() if t["state"] != "ready"]
        if not loading:
            return True
        done = sum(t["progress"][0] for t in mine.values())
        total = sum(t["progress"][1] for t in mine.values()) or 1
        if time.monotonic() > deadline:
            raise StorageError(f"the table service at {path} is still loading this rank's "
                               f"tables after {timeout_s:g} s ({done / total:.0%} of "
                               f"{total} bytes); wait for `numa-engram status` to say ready, "
                               "raise timeout_s, or pass service=None to build here")
        if time.monotonic() - said >= 5.0:
            said = time.monotonic()
            log.info("Engram runtime: the table service at %s is loading layers %s (%.0f%% "
                     "of this rank's bytes); waiting", path,
                     sorted({t["layer"] for t in loading}), 100 * done / total)
        time.sleep(0.2)
