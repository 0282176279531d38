"""Where the pages live: a PlacementPlan maps byte ranges of a backing file
to a NUMA policy, ``apply`` binds them before population and ``verify``
reports, page by page, where they really are.

Policies an operator chooses from (docs/design.md, "Modes and placement"): ``gpu-local``,
``node:N``, ``interleave``, ``replicate-per-node`` (one copy per node, each
bound locally) and ``none`` (first touch).  No torch here.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..bindings import native
from ..errors import PlacementError, TopologyError
from ..host.topology import Topology
from ..model.family import TableFamily
from ..model.sharding import WorldLayout, assign
from ..units import fmt_bytes, node_list, parse_cpulist, text_table, unit_for

MPOL_MODES = {"bind": native.MPOL_BIND, "preferred": native.MPOL_PREFERRED,
         "interleave": native.MPOL_INTERLEAVE, "default": native.MPOL_DEFAULT}
POLICIES = ("gpu-local", "node:N", "bind:NODES", "preferred:N", "interleave",
            "interleave:NODES", "replicate-per-node", "none")
NODE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")  # numactl's 0-1,3
NODE_LIST_POLICIES = {"node": "bind", "bind": "bind", "preferred": "preferred",
                      "interleave": "interleave"}


@dataclass(frozen=True)
class PlacementRange:
    """One byte range of the file and the policy its pages get."""

    name: str
    offset: int
    length: int
    memory_policy: str  # the kernel's: bind | preferred | interleave | default
    nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Region:
    """A range to be placed and the NUMA nodes of the GPUs/processes that read it."""

    name: str
    offset: int
    length: int
    reader_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlacementPlan:
    ranges: tuple[PlacementRange, ...]
    policy: str = "custom"
    copies: int = 1  # replicate-per-node: one copy of the table per node

    def validate(self, file_size: int, topology: Topology | None = None,
                 page_size: int = native.PAGE_SIZE) -> None:
        """Refuse unaligned, overlapping or out-of-file ranges and unknown nodes
        before any syscall is made (a hugetlb file's ranges start on its
        huge page boundaries: mbind refuses anything else)."""
        page = page_size
        spans = []
        for r in self.ranges:
            if r.memory_policy not in MPOL_MODES:
                raise PlacementError(f"range {r.name!r}: memory policy {r.memory_policy!r} is not "
                                     f"one of {sorted(MPOL_MODES)}")
            if r.offset < 0 or r.offset % page:
                raise PlacementError(f"range {r.name!r}: offset {r.offset} is not aligned to the "
                                     f"page size {page}; align range starts to pages")
            if r.length <= 0 or r.offset + r.length > file_size:
                raise PlacementError(f"range {r.name!r}: [{r.offset}, {r.offset + r.length}) is "
                                     f"outside the file of {file_size} bytes")
            if r.memory_policy != "default":
                if not r.nodes:
                    raise TopologyError(f"range {r.name!r}: empty node set for memory policy "
                                        f"{r.memory_policy}; name at least one NUMA node")
                if topology is not None:
                    topology.check_nodes(r.nodes)
            spans.append((r.offset, r.offset + r.length, r.name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise PlacementError(f"ranges {a!r} and {b!r} overlap; give disjoint ranges")

    def apply(self, mapping: native.Mapping, topology: Topology | None = None) -> None:
        """mbind every range.  On tmpfs the policy is stored on the file, so
        every later fault by any process obeys it; on hugetlbfs it stays on
        this mapping, so the creator populates every page through it."""
        self.validate(mapping.length, topology or Topology.detect(), mapping.page_size)
        for r in self.ranges:
            length = min(_round_up(r.length, mapping.page_size), mapping.length - r.offset)
            native.mbind(mapping, r.offset, length, MPOL_MODES[r.memory_policy], r.nodes)

    def bytes_per_node(self) -> dict[int, int]:
        """Planned bytes on each node (interleave split evenly)."""
        out: Counter[int] = Counter()
        for r in self.ranges:
            for node in r.nodes:
                out[node] += r.length // len(r.nodes)
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return {"policy": self.policy, "copies": self.copies,
                "ranges": [vars(r) | {"nodes": list(r.nodes)} for r in self.ranges],
                "bytes_per_node": self.bytes_per_node()}

    @classmethod
    def from_dict(cls, doc: dict) -> PlacementPlan:
        """The plan ``to_dict`` wrote (e.g. the one stored in a table's header)."""
        try:
            ranges = tuple(PlacementRange(r["name"], int(r["offset"]), int(r["length"]),
                                          str(r["memory_policy"]),
                                          tuple(int(n) for n in r["nodes"]))
                           for r in doc["ranges"])
            return cls(ranges, str(doc.get("policy", "custom")), int(doc.get("copies", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlacementError(f"not a placement plan: {exc!r} in {doc!r}") from None


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def parse_policy(policy: str) -> tuple[str, tuple[int, ...] | None]:
    """Policies as numactl takes them: 'node:1' and 'bind:0-1' -> ('bind',
    nodes), 'preferred:1', 'interleave:0,2' (bare 'interleave': every node,
    nodes None); 'gpu-local' -> ('gpu-local', None)."""
    kind, sep, nodes_text = policy.partition(":")
    if sep and kind in NODE_LIST_POLICIES:
        nodes = parse_cpulist(nodes_text) if NODE_LIST.match(nodes_text) else ()
        if not nodes or min(nodes) < 0 or (kind in ("node", "preferred") and len(nodes) != 1):
            one = kind in ("node", "preferred")
            raise PlacementError(f"bad policy {policy!r}: write {kind}:N with N a node id >= 0"
                                 + ("" if one else " or a list like 0-1,3")
                                 + " (numa-engram topo lists them)")
        return NODE_LIST_POLICIES[kind], nodes
    if policy in ("gpu-local", "interleave", "replicate-per-node", "none"):
        return policy, None
    raise PlacementError(f"unknown placement policy {policy!r}; choose one of {list(POLICIES)}")


def plan_placement(policy: str, regions: Sequence[Region], topology: Topology) -> PlacementPlan:
    """A plan for ``regions`` under ``policy`` on ``topology``.

    gpu-local binds each region to the node most of its readers sit on;
    without readers it falls back to node 0 of the topology (the caller
    passes the leader's node as reader in that case)."""
    kind, nodes = parse_policy(policy)
    if nodes is not None:
        topology.check_nodes(nodes)
    ranges = []
    for reg in regions:
        if kind in ("bind", "preferred") and nodes is not None:  # parse_policy gives them
            ranges.append(PlacementRange(reg.name, reg.offset, reg.length, kind, nodes))
        elif kind == "interleave":
            ranges.append(PlacementRange(reg.name, reg.offset, reg.length, "interleave",
                                         nodes or topology.node_ids))
        elif kind == "none":
            ranges.append(PlacementRange(reg.name, reg.offset, reg.length, "default", ()))
        else:  # gpu-local, replicate-per-node (each copy's readers are node-local)
            ranges.append(PlacementRange(reg.name, reg.offset, reg.length, "bind",
                                         (_majority_node(reg, topology),)))
    copies = len(topology.nodes) if kind == "replicate-per-node" else 1
    return PlacementPlan(tuple(ranges), policy, copies)


def _majority_node(region: Region, topology: Topology) -> int:
    if not region.reader_nodes:
        return topology.nodes[0].id
    for n in region.reader_nodes:
        topology.node(n)
    counts = Counter(region.reader_nodes)
    return max(sorted(counts), key=lambda n: counts[n])


def expected_remote_fraction(plan: PlacementPlan, regions: Sequence[Region]) -> float:
    """Expected fraction of row reads that cross a socket, weighting each
    region by its size and each reader equally."""
    if plan.policy == "replicate-per-node":
        return 0.0
    by_name = {r.name: r for r in plan.ranges}
    remote = total = 0.0
    for reg in regions:
        placed = by_name[reg.name]
        for reader in reg.reader_nodes:
            total += reg.length
            if placed.memory_policy == "default" or not placed.nodes:
                continue  # first touch: unknown, counted local
            local = placed.nodes.count(reader) / len(placed.nodes)
            remote += reg.length * (1.0 - local)
    return remote / total if total else 0.0


# ------------------------------------------------------------ reporting --

@dataclass(frozen=True)
class RangeReport:
    name: str
    offset: int
    length: int
    memory_policy: str
    planned_nodes: tuple[int, ...]
    pages: int
    pages_per_node: dict[int, int] = field(default_factory=dict)
    unmapped_pages: int = 0
    page_size: int = native.PAGE_SIZE

    @property
    def pages_on_plan(self) -> int:
        if self.memory_policy == "default" or not self.planned_nodes:
            return self.pages - self.unmapped_pages
        return sum(c for n, c in self.pages_per_node.items() if n in self.planned_nodes)

    @property
    def fraction_on_plan(self) -> float:
        return self.pages_on_plan / self.pages if self.pages else 1.0

    @property
    def interleave_spread(self) -> int:
        """max - min pages over the planned nodes (0 or 1 when perfectly even)."""
        counts = [self.pages_per_node.get(n, 0) for n in self.planned_nodes] or [0]
        return max(counts) - min(counts)

    def to_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "length": self.length,
                "memory_policy": self.memory_policy, "planned_nodes": list(self.planned_nodes),
                "pages": self.pages, "pages_per_node": dict(self.pages_per_node),
                "unmapped_pages": self.unmapped_pages, "page_size": self.page_size,
                "fraction_on_plan": self.fraction_on_plan}


@dataclass(frozen=True)
class PlacementReport:
    ranges: tuple[RangeReport, ...]

    @property
    def fraction_on_plan(self) -> float:
        pages = sum(r.pages for r in self.ranges)
        return sum(r.pages_on_plan for r in self.ranges) / pages if pages else 1.0

    @property
    def ok(self) -> bool:
        return all(r.pages_on_plan == r.pages for r in self.ranges)

    def pages_per_node(self) -> dict[int, int]:
        total: Counter[int] = Counter()
        for r in self.ranges:
            total.update(r.pages_per_node)
        return dict(sorted(total.items()))

    def bytes_per_node(self) -> dict[int, int]:
        total: Counter[int] = Counter()
        for r in self.ranges:
            total.update({n: c * r.page_size for n, c in r.pages_per_node.items() if n >= 0})
        return dict(sorted(total.items()))

    def to_dict(self) -> dict:
        return {"ok": self.ok, "fraction_on_plan": self.fraction_on_plan,
                "pages_per_node": self.pages_per_node(),
                "bytes_per_node": self.bytes_per_node(),
                "ranges": [r.to_dict() for r in self.ranges]}

    def format(self) -> str:
        """numastat-like: one row per range, a column per node in one unit,
        the pages (and their size) under it."""
        nodes = sorted({n for r in self.ranges for n in r.pages_per_node})
        unit = unit_for(*(r.length for r in self.ranges))
        rows = []
        for r in self.ranges:
            rows.append([r.name, r.memory_policy, node_list(r.planned_nodes)]
                        + [f"{r.pages_per_node.get(n, 0) * r.page_size / unit[1]:.2f}"
                           for n in nodes] + [f"{r.fraction_on_plan:.1%}"])
        total = self.bytes_per_node()
        rows.append(["Total", "", ""] + [f"{total.get(n, 0) / unit[1]:.2f}" for n in nodes]
                    + [f"{self.fraction_on_plan:.1%}"])
        header = (["range", "memory policy", "plan"] + [f"Node {n} ({unit[0]})" for n in nodes]
                  + ["on plan"])
        pages = self.pages_per_node()
        sizes = sorted({r.page_size for r in self.ranges})
        note = ("pages of " + ", ".join(fmt_bytes(s, digits=0) for s in sizes) + ": "
                + "  ".join(f"Node {n}={pages[n]}" for n in nodes if n >= 0))
        return text_table(header, rows, left=3) + "\n" + note


def verify(mapping: native.Mapping, plan: PlacementPlan) -> PlacementReport:
    """Where each page of each planned range really is (move_pages query).

    Pages of the file that this process has not mapped yet are mapped first
    with MADV_POPULATE_READ, so a peer that attached without touching the
    table sees the same report as the creator."""
    reports = []
    for r in plan.ranges:
        length = min(_round_up(r.length, mapping.page_size), mapping.length - r.offset)
        native.madvise(mapping, native.MADV_POPULATE_READ, r.offset, length)
        status = native.page_nodes(mapping, r.offset, length)
        counts = np.bincount(status[status >= 0])
        per_node = {node: int(c) for node, c in enumerate(counts) if c}
        reports.append(RangeReport(r.name, r.offset, r.length, r.memory_policy, r.nodes,
                                   len(status), per_node, int((status < 0).sum()),
                                   mapping.page_size))
    return PlacementReport(tuple(reports))


_MODE_NAMES = {v: k for k, v in MPOL_MODES.items()}


def plan_of_mapping(mapping: native.Mapping,
                    ranges: Sequence[tuple[str, int, int]]) -> PlacementPlan:
    """The plan as the kernel holds it: the policy stored on each range
    (get_mempolicy per range start), so a peer can verify without being told."""
    out = []
    for name, offset, length in ranges:
        mode, nodes = native.policy_of_address(mapping, offset)
        mode_name = _MODE_NAMES.get(mode, "default")
        out.append(PlacementRange(name, offset, length, mode_name,
                                  tuple(nodes) if mode_name != "default" else ()))
    return PlacementPlan(tuple(out), "from-file")


def host_regions(spec: TableFamily, world: WorldLayout, mode: str,
                 topology: Topology) -> list[Region]:
    """The regions one host's tables occupy under ``mode`` (one per layer
    and distinct shard copy), each with the NUMA nodes of the GPUs that
    read it: what ``plan_placement`` places.  ``world``: the WorldLayout."""
    per_host = world.gpus_per_host
    regions, offset, seen = [], 0, set()
    for rank in range(min(world.world_size, per_host)):  # the first host's ranks
        a = assign(mode, world, rank)
        key = (a.shard_index, a.sharing_group)
        if key in seen:
            continue
        seen.add(key)
        readers = tuple(topology.nearest_node(m % per_host) if topology.gpus
                        else topology.nodes[0].id for m in a.sharing_group)
        for layer in spec.layer_ids:
            size = spec.shard_bytes(layer, a.num_shards, a.shard_index)
            regions.append(Region(f"L{layer}/s{a.shard_index}/r{rank}", offset, size, readers))
            offset += size
    return regions


def planned_bytes_per_node(plan: PlacementPlan, regions: Sequence[Region],
                           topology: Topology) -> dict[int, int]:
    """Bytes on each NUMA node under ``plan`` (replicate-per-node: a whole
    copy on every node)."""
    if plan.copies > 1:
        return {n: sum(r.length for r in regions) for n in topology.node_ids}
    return plan.bytes_per_node()
