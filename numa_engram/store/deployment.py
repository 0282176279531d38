"""What one host of a deployment needs (``numa-engram plan``): per policy the
bytes on each NUMA node, the physical copies, the expected remote reads;
per process and per host the page tables; whether it fits the host's
nodes, and the commands that make it fit; the memory each sharing mode
takes per rank and per host.  Arithmetic only: no torch, no allocation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import TopologyError
from ..host.hugepages import SIZES, name_of, page_table_bytes
from ..host.topology import Topology
from ..model.families import family_of
from ..model.family import TableFamily
from ..model.sharding import WorldLayout, assign
from ..units import fmt_bytes, node_list
from .placement import (
    Region,
    expected_remote_fraction,
    host_regions,
    plan_placement,
    planned_bytes_per_node,
)

ALTERNATIVES = ("gpu-local", "interleave", "replicate-per-node")
REGION_LEGEND = ("region L<layer>/s<shard>/r<rank>: the layer, the shard (the TP rank's heads, "
                 "or its TP x EDP slice in dp_sharded) and the first rank that maps it")


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy under one mode, on one host."""

    policy: str
    mode: str
    bytes_per_node: dict[int, int]
    host_bytes: int               # physical bytes of every table copy on the host
    copies: float                 # host_bytes over one copy of the model's tables
    remote_fraction: float | None  # None: unknown (first touch decides)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "mode": self.mode, "bytes_per_node": self.bytes_per_node,
                "host_bytes": self.host_bytes, "copies": self.copies,
                "remote_fraction": self.remote_fraction}


@dataclass(frozen=True)
class Deployment:
    """The plan of one host: the chosen outcome, its regions, the
    alternatives, page tables, capacity and notes."""

    spec: TableFamily
    world: WorldLayout
    chosen: PolicyOutcome
    plan: object
    regions: list[Region]
    alternatives: list[PolicyOutcome]
    mapped_per_process: dict[int, int]     # rank (on the first host) -> bytes it maps
    notes: list[str] = field(default_factory=list)
    shortfalls: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.shortfalls

    def page_tables(self) -> dict[str, dict[str, int]]:
        """Last-level page-table bytes per process (the largest) and per
        host (every process), for each page size."""
        return {name: {"per_process": max(page_table_bytes(b, size)
                                          for b in self.mapped_per_process.values()),
                       "per_host": sum(page_table_bytes(b, size)
                                       for b in self.mapped_per_process.values())}
                for name, size in SIZES.items()}


def outcome(spec: TableFamily, world: WorldLayout, mode: str, policy: str,
            topo: Topology) -> tuple[PolicyOutcome, object, list[Region]]:
    regions = host_regions(spec, world, mode, topo)
    plan = plan_placement(policy, regions, topo)
    per_node = planned_bytes_per_node(plan, regions, topo)
    placed = sum(per_node.values()) or sum(r.length for r in regions)  # none: not on a node yet
    if policy != "none":  # every node, those the plan leaves empty too
        per_node = {n: per_node.get(n, 0) for n in sorted({*topo.node_ids, *per_node})}
    remote = None if policy == "none" else expected_remote_fraction(plan, regions)
    return (PolicyOutcome(policy, mode, per_node, placed, placed / spec.table_bytes(), remote),
            plan, regions)


def plan_deployment(spec: TableFamily, world: WorldLayout, mode: str, policy: str,
                    topo: Topology, page_size: int = SIZES["4K"]) -> Deployment:
    chosen, plan, regions = outcome(spec, world, mode, policy, topo)
    alternatives = [outcome(spec, world, mode, p, topo)[0] for p in ALTERNATIVES if p != policy]
    unsharded = None
    if mode != "dp_sharded":
        try:
            alternatives.append(outcome(spec, world, "dp_sharded", "gpu-local", topo)[0])
        except TopologyError as exc:  # only the comparison: the plan asked for is sound
            unsharded = f"dp_sharded is not an option here: {exc}"
    mapped = _mapped_per_process(spec, world, mode)
    deployment = Deployment(spec, world, chosen, plan, regions, alternatives, mapped)
    if unsharded:
        deployment.notes.append(unsharded)
    deployment.notes.extend(_notes(spec, world, mode, policy, chosen, regions))
    _check_capacity(deployment, topo, page_size)
    return deployment


def _mapped_per_process(spec: TableFamily, world: WorldLayout, mode: str) -> dict[int, int]:
    """Bytes each rank of the first host maps: its TP shard (or DP-sharded
    slice) of every layer, whoever holds the copy."""
    out = {}
    for rank in range(min(world.world_size, world.gpus_per_host)):
        a = assign(mode, world, rank)
        out[rank] = sum(spec.shard_bytes(layer, a.num_shards, a.shard_index)
                        for layer in spec.layer_ids)
    return out


def _notes(spec: TableFamily, world: WorldLayout, mode: str, policy: str,
           chosen: PolicyOutcome, regions: list[Region]) -> list[str]:
    notes = family_of(spec).sharding_notes(spec, world)
    if mode == "dp_shared" and world.edp_size() == 1 and world.dp > 1:
        why = (f"TP {world.tp} does not divide the {world.gpus_per_host} GPUs of a host"
               if world.gpus_per_host % world.tp else
               f"gcd(DP {world.dp}, {world.gpus_per_host // world.tp} replicas per host) is 1")
        notes.append(f"sharing lost: {why}, so every rank holds its own copy (as independent)")
    spanning = [r for r in regions if len(set(r.reader_nodes)) > 1]
    if policy == "gpu-local" and spanning:
        readers = node_list({n for r in spanning for n in r.reader_nodes})
        notes.append(f"gpu-local falls back: the ranks sharing each table read from nodes "
                     f"{readers}, so each table goes on one node (its first reader's) and "
                     f"{chosen.remote_fraction:.0%} of reads cross a socket; replicate-per-node "
                     "(a copy per socket) or dp_sharded (each slice on its reader's node) read "
                     "locally")
    if policy == "none":
        notes.append("policy none: pages land where they are first touched (by the loader), "
                     "so bytes per node and remote reads are unknown until verify measures them")
    return notes


def recommendation(d: Deployment) -> str:
    """The outcome with the fewest remote reads that fits (then the least memory)."""
    candidates = [o for o in [d.chosen, *d.alternatives] if o.remote_fraction is not None]
    best = min(candidates, key=lambda o: (o.remote_fraction, o.host_bytes))
    return (f"recommended: --mode {best.mode} --policy {best.policy} ({best.remote_fraction:.0%} "
            f"remote reads, {best.copies:.2f} copies on the host)")


def _check_capacity(d: Deployment, topo: Topology, page_size: int) -> None:
    """Every node's memory against what the plan puts on it; the commands
    that fix a shortfall (huge-page pools per node)."""
    huge = page_size != SIZES["4K"]
    for node in topo.nodes:
        need = d.chosen.bytes_per_node.get(node.id, 0)
        if node.mem_total and need > node.mem_total:
            d.shortfalls.append(f"node {node.id} needs {fmt_bytes(need)} of its "
                                f"{fmt_bytes(node.mem_total)}")
        if huge and need:
            pages = -(-need // page_size)
            d.fixes.append(f"echo {pages} > /sys/devices/system/node/node{node.id}/hugepages/"
                           f"hugepages-{page_size >> 10}kB/nr_hugepages   # node {node.id}: "
                           f"{pages} pages of {name_of(page_size)}")
    if d.shortfalls:
        d.fixes.insert(0, "the tables do not fit these nodes: add nodes or memory, use "
                          "dp_sharded (a slice per rank), fewer copies (no replicate-per-node), "
                          "or more hosts (fewer replicas per host)")


# ------------------------------------------------- memory per mode --
# Exact bytes from per-shard row counts (prime bucket sizes make W/T only
# approximate).


@dataclass(frozen=True)
class ModeMemory:
    mode: str
    per_rank: dict[int, int]   # bytes each rank's shard(s) occupy (attributed, not PSS)
    per_host: dict[int, int]   # physical bytes on each host (shared copies counted once)

    @property
    def total(self) -> int:
        return sum(self.per_host.values())


def mode_memory(spec: TableFamily, mode: str, world: WorldLayout) -> ModeMemory:
    """Host bytes per rank and per host of all Engram layers under a mode."""
    per_rank: dict[int, int] = {}
    per_host: Counter[int] = Counter()
    holders: set[tuple[int, ...]] = set()
    for rank in range(world.world_size):
        a = assign(mode, world, rank)
        size = sum(spec.shard_bytes(layer, a.num_shards, a.shard_index)
                   for layer in spec.layer_ids)
        per_rank[rank] = size
        if a.sharing_group not in holders:  # one physical copy per sharing group
            holders.add(a.sharing_group)
            per_host[world.host_of(rank)] += size
    return ModeMemory(mode, per_rank, dict(sorted(per_host.items())))


# ------------------------------------------------------------ tiers --
# Per mode: the resident tier (the tables in memory, as above) against the
# memory budget, else the mapped tier (the checkpoint's pages in the page
# cache, one copy per host whatever the mode, the cold ones evicted) with
# the hit rate a row-access profile expects of the budget.


@dataclass(frozen=True)
class TierVerdict:
    mode: str
    resident_bytes: int        # the mode's tables on the planned host
    budget: int | None         # None: unknown
    tier: str                  # "resident", "mapped", "neither" or "unknown"
    hit_rate: float | None     # the mapped tier's expected page hits (None: no profile)
    why: str

    def to_dict(self) -> dict:
        return {"mode": self.mode, "resident_bytes": self.resident_bytes,
                "budget": self.budget, "tier": self.tier, "hit_rate": self.hit_rate,
                "why": self.why}


def step_bytes(spec: TableFamily, batch: int) -> int:
    """The pages one step of ``batch`` tokens may read, every layer: a row
    read touches each page its bytes span in each row region (at most
    ceil(w / 4 KiB) + 1 of a w-byte row)."""
    page = SIZES["4K"]
    per_row = sum(-(-w // page) + (1 if page % w else 0) for _, w in spec.row_regions())
    return batch * spec.n_hash_cols * len(spec.layer_ids) * per_row * page


def tier_verdict(spec: TableFamily, mode: str, resident_bytes: int, budget: int | None,
                 batch: int, hit_rate: Callable[[int], float] | None) -> TierVerdict:
    """Resident when the mode's tables fit the budget; else mapped when the
    budget holds at least one step's pages (fewer would evict rows the
    same step reads), with the hit rate ``hit_rate(budget)`` expects; else
    neither."""
    table = spec.table_bytes()
    if budget is None:
        return TierVerdict(mode, resident_bytes, None, "unknown", None,
                           "no memory budget known: pass --memory-budget")
    if resident_bytes <= budget:
        return TierVerdict(mode, resident_bytes, budget, "resident", None,
                           f"{fmt_bytes(resident_bytes)} of tables fit {fmt_bytes(budget)}")
    step = step_bytes(spec, batch)
    if budget < step:
        return TierVerdict(mode, resident_bytes, budget, "neither", None,
                           f"{fmt_bytes(resident_bytes)} of tables do not fit "
                           f"{fmt_bytes(budget)}, which holds less than one step's pages "
                           f"({fmt_bytes(step)} at {batch} tokens): a mapped table would "
                           "evict rows the same step reads")
    rate = 1.0 if budget >= table else (hit_rate(budget) if hit_rate else None)
    said = ("every row once warm" if budget >= table else
            f"up to {rate:.1%} of page reads from memory (the hottest pages kept; the "
            "kernel's LRU keeps fewer)" if rate is not None else
            "hit rate unknown: pass --profile (numa-engram profile)")
    return TierVerdict(mode, resident_bytes, budget, "mapped", rate,
                       f"{fmt_bytes(resident_bytes)} of tables do not fit {fmt_bytes(budget)}; "
                       f"tier='mapped' keeps the hottest {fmt_bytes(min(budget, table))} of "
                       f"the checkpoint's {fmt_bytes(table)} in the page cache: {said}")
