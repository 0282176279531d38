"""Placement on a kernel with >= 2 NUMA nodes (the tools/numa-vm guest on
single-node hosts; directly on a real multi-socket host)."""

import json

import pytest

from numa_engram.bindings import native
from numa_engram.host.topology import Topology
from numa_engram.store.fileformat import Layout
from numa_engram.store.placement import (
    PlacementPlan,
    PlacementRange,
    Region,
    plan_of_mapping,
    plan_placement,
    verify,
)
from numa_engram.store.storage import BackingFile

from .conftest import run_python

pytestmark = pytest.mark.numa
FP = b"\7" * 32
SIZE = 64 << 20


def _per_node_layout(nodes):
    share = SIZE // len(nodes)
    return Layout.of([(f"shard{n}", share) for n in nodes])


def _bind_each_region(layout, nodes):
    return PlacementPlan(tuple(PlacementRange(r.name, r.offset, r.length, "bind", (n,))
                               for r, n in zip(layout.regions, nodes)))


ATTACH_AND_VERIFY = """
    import json, sys
    from numa_engram.store.placement import plan_of_mapping, verify
    from numa_engram.store.storage import BackingFile
    f = BackingFile.attach(sys.argv[1])
    plan = plan_of_mapping(f.mapping, [(r.name, r.offset, r.length) for r in f.layout.regions])
    print(json.dumps(verify(f.mapping, plan).to_dict()))
    f.close()
"""


def test_ranges_bound_to_different_nodes_are_fully_placed(numa_nodes):
    layout = _per_node_layout(numa_nodes)
    plan = _bind_each_region(layout, numa_nodes)
    with BackingFile.create(layout, FP, placement=plan) as table:
        report = verify(table.mapping, plan)
        assert report.ok, report.format()
        for r, node in zip(report.ranges, numa_nodes):
            assert r.pages_per_node == {node: r.pages} and r.fraction_on_plan == 1.0
        # a second process that binds nothing sees the same pages on the same nodes
        peer = run_python(ATTACH_AND_VERIFY, table.path)
        assert peer.returncode == 0, peer.stderr
        seen = json.loads(peer.stdout)
        assert seen["ok"] and seen["fraction_on_plan"] == 1.0
        assert [r["pages_per_node"] for r in seen["ranges"]] == [
            {str(n): r.pages} for r, n in zip(report.ranges, numa_nodes)]


def test_policy_is_kept_on_the_file(numa_nodes):
    layout = _per_node_layout(numa_nodes)
    plan = _bind_each_region(layout, numa_nodes)
    with BackingFile.create(layout, FP, placement=plan) as table:
        peer = BackingFile.attach(table.path)
        stored = plan_of_mapping(peer.mapping, [(r.name, r.offset, r.length)
                                                for r in layout.regions])
        assert [(r.memory_policy, r.nodes) for r in stored.ranges] == [("bind", (n,))
                                                                       for n in numa_nodes]
        peer.close()


def test_interleave_spreads_pages_evenly(numa_nodes):
    layout = Layout.of([("weights", SIZE)])
    topo = Topology.detect()
    plan = plan_placement("interleave", [Region("weights", layout.regions[0].offset, SIZE)], topo)
    with BackingFile.create(layout, FP, placement=plan) as table:
        r = verify(table.mapping, plan).ranges[0]
        assert set(r.pages_per_node) == set(numa_nodes), r.pages_per_node
        assert r.interleave_spread <= 1, r.pages_per_node
        assert r.fraction_on_plan == 1.0


def test_gpu_local_plan_on_this_host_places_each_shard_on_its_readers_node(numa_nodes):
    layout = _per_node_layout(numa_nodes)
    regions = [Region(r.name, r.offset, r.length, (n,)) for r, n in zip(layout.regions,
                                                                         numa_nodes)]
    plan = plan_placement("gpu-local", regions, Topology.detect())
    with BackingFile.create(layout, FP, placement=plan) as table:
        report = verify(table.mapping, plan)
        assert report.ok and report.pages_per_node() == {
            n: r.pages for n, r in zip(numa_nodes, report.ranges)}


def test_preferred_policy_lands_on_preferred_node(numa_nodes):
    last = numa_nodes[-1]
    layout = Layout.of([("w", 4 << 20)])
    plan = PlacementPlan((PlacementRange("w", layout.regions[0].offset, 4 << 20, "preferred",
                                         (last,)),))
    with BackingFile.create(layout, FP, placement=plan) as table:
        assert verify(table.mapping, plan).ranges[0].pages_per_node == {
            last: (4 << 20) // native.PAGE_SIZE}


def test_topology_sees_every_node(numa_nodes):
    topo = Topology.detect()
    assert topo.node_ids == numa_nodes
    assert all(len(n.distances) == len(numa_nodes) for n in topo.nodes)
    assert not any("disagree" in note for note in topo.notes), topo.notes


def test_a_table_larger_than_its_nodes_free_memory_is_refused_before_allocating(numa_nodes):
    from numa_engram.errors import CapacityError
    from numa_engram.host.accounting import node_free_bytes
    from numa_engram.host.procfs import meminfo as read_meminfo

    node = numa_nodes[-1]
    size = (node_free_bytes(node) + (64 << 20)) // native.PAGE_SIZE * native.PAGE_SIZE
    if size >= read_meminfo()["MemAvailable"]:
        pytest.skip(f"node {node}'s free memory is most of the guest's: the host-wide check "
                    "would answer first")
    layout = Layout.of([("w", size)])
    plan = _bind_each_region(layout, [node])
    before = read_meminfo()["MemFree"]
    with pytest.raises(CapacityError, match=f"on NUMA node {node}, which has"):
        BackingFile.create(layout, FP, placement=plan, directory=None)
    assert read_meminfo()["MemFree"] > before - (32 << 20), "nothing was allocated"


def test_interleave_over_a_node_list_uses_only_those_nodes(numa_nodes):
    chosen = numa_nodes[-2:]
    layout = Layout.of([("w", SIZE)])
    regions = [Region(r.name, r.offset, r.length, ()) for r in layout.regions]
    plan = plan_placement(f"interleave:{chosen[0]},{chosen[1]}", regions, Topology.detect())
    with BackingFile.create(layout, FP, placement=plan) as table:
        report = verify(table.mapping, plan)
        assert report.ok, report.format()
        pages = report.ranges[0].pages_per_node
        assert set(pages) == set(chosen), pages
        assert abs(pages[chosen[0]] - pages[chosen[1]]) <= 1, pages
