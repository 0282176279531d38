"""A DP-shared table placed across NUMA nodes, seen from every member
(runs in the NUMA guests on single-node hosts): the members meet through
SocketGroup and import no torch."""

import pytest

from .support.socketworld import run_socket_world

pytestmark = [pytest.mark.numa, pytest.mark.multiproc]


def test_two_tp_shards_on_two_nodes_report_full_placement_from_every_member(numa_nodes,
                                                                            tmp_path):
    results = run_socket_world(4, "share_placed", timeout_s=900, meet=str(tmp_path), tp=2)
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert not r["torch_imported"], r
        node = r["rank"] % 2
        assert r["mode"]["mode"] == "dp_shared" and r["mode"]["sharing_group"] == [node,
                                                                                   node + 2]
        placement = r["placement"]
        assert placement["ok"] and placement["fraction_on_plan"] == 1.0, placement
        assert set(placement["pages_per_node"]) == {str(node)}, placement
        print(f"rank {r['rank']}: TP shard {node} pages per node {placement['pages_per_node']}")
