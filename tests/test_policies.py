"""Placement policies as numactl takes them, planned on a simulated host
(the pages are checked in the NUMA guests: tests/test_numa_placement.py)."""

import pytest

from numa_engram.errors import PlacementError, TopologyError
from numa_engram.host.topology import Topology
from numa_engram.store.placement import Region, parse_policy, plan_placement

TOPO = Topology.from_dict({"sockets": 4, "gpus_per_socket": 2})
REGIONS = [Region("weights", 4096, 1 << 20, (0,)), Region("scales", 4096 + (1 << 20), 4096, (0,))]


@pytest.mark.parametrize("policy, mode, nodes", [
    ("node:2", "bind", (2,)),
    ("bind:0-1", "bind", (0, 1)),
    ("bind:1,3", "bind", (1, 3)),
    ("preferred:3", "preferred", (3,)),
    ("interleave", "interleave", (0, 1, 2, 3)),
    ("interleave:0,2", "interleave", (0, 2)),
])
def test_node_list_policies_plan_every_range(policy, mode, nodes):
    plan = plan_placement(policy, REGIONS, TOPO)
    assert [(r.memory_policy, r.nodes) for r in plan.ranges] == [(mode, nodes)] * 2


@pytest.mark.parametrize("policy, text", [
    ("bind:", "bind:N with N a node id >= 0 or a list"),
    ("bind:x", "bind:N"),
    ("preferred:0-1", "preferred:N with N a node id"),
    ("node:-1", "node:N"),
    ("interleave:2-", "interleave:N"),
    ("sideways", "unknown placement policy"),
])
def test_malformed_policies_name_themselves(policy, text):
    with pytest.raises(PlacementError, match=text):
        parse_policy(policy)


def test_nodes_the_host_lacks_are_refused():
    with pytest.raises(TopologyError, match="7"):
        plan_placement("bind:0,7", REGIONS, TOPO)


def test_a_plan_round_trips_and_refuses_a_doc_without_memory_policy():
    from numa_engram.store.placement import PlacementPlan, PlacementRange

    plan = PlacementPlan((PlacementRange("w", 4096, 8192, "bind", (1,)),), "node:1")
    doc = plan.to_dict()
    assert doc["ranges"][0]["memory_policy"] == "bind" and "mode" not in doc["ranges"][0]
    assert PlacementPlan.from_dict(doc) == plan
    old = {**doc, "ranges": [{"name": "w", "offset": 4096, "length": 8192, "mode": "bind",
                              "nodes": [1]}]}  # the key's name in 0.2
    with pytest.raises(PlacementError, match="not a placement plan: KeyError\\('memory_policy'"):
        PlacementPlan.from_dict(old)
