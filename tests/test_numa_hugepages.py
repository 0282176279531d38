"""Hugetlb tables on a kernel with >= 2 NUMA nodes (the tools/numa-vm guest):
a pool reserved per node, pages where the plan says (populated through the
creator's bound mapping, since a hugetlb file keeps no policy), lookups
bit-exact, and a node's pool too small refused before anything exists."""

import os

import numpy as np
import pytest

from numa_engram import SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_raw_checkpoint, write_synthetic_checkpoint
from numa_engram.errors import CapacityError
from numa_engram.host import hugepages
from numa_engram.host.topology import Topology
from numa_engram.lookup.cpu import reference_lookup
from numa_engram.store.fileformat import Layout
from numa_engram.store.placement import PlacementPlan, PlacementRange, verify
from numa_engram.store.storage import BackingFile

from .conftest import run_python
from .support.socket_scenarios import LAYER, make_spec
from .support.socketworld import run_socket_world

pytestmark = pytest.mark.numa
MIB2 = 2 << 20
ROWS_PER_HEAD = 4000


def _node_free(node: int) -> int:
    return hugepages.pool_pages(MIB2, node)


@pytest.mark.torch
@pytest.mark.parametrize("shared", [True, False], ids=["hugetlbfs", "memfd"])
def test_pages_land_on_the_bound_node_and_lookups_are_exact(tmp_path, numa_nodes, huge_pool,
                                                            shared):
    import torch

    node = numa_nodes[-1]
    for n in numa_nodes:
        huge_pool.reserve(8, n)
    spec = make_spec(ROWS_PER_HEAD)
    ckpt = write_synthetic_checkpoint(tmp_path / "engram.safetensors", spec)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    before = {n: _node_free(n) for n in numa_nodes}
    with SharedEngramTable.create(spec, LAYER, shard, checkpoint=str(ckpt), page_size="2M",
                                  placement=f"node:{node}",
                                  directory=huge_pool.mount if shared else "/dev/shm") as t:
        report = t.placement_report()
        planned = sum(-(-r.length // MIB2) * MIB2 for r in t._backing.layout.regions)
        assert report.ok and report.bytes_per_node() == {node: planned}
        taken = {n: before[n] - _node_free(n) for n in numa_nodes}
        # every planned page from that node's pool (the header in the last
        # one's padding, written after the bind); a header page of its own,
        # when the padding is too small, from wherever this process ran
        assert sum(taken.values()) == t.backing_bytes // MIB2
        assert taken[node] >= planned // MIB2
        ids = np.random.default_rng(1).integers(0, 1 << 40, (400, spec.n_hash_cols))
        ids %= np.asarray(spec.bucket_sizes(LAYER))
        want = reference_lookup(t.weights, t.scales, ids, head_start=0,
                                bucket_sizes=spec.bucket_sizes(LAYER))
        assert torch.equal(t.lookup(ids).view(torch.int16), want.view(torch.int16))
    assert {n: _node_free(n) for n in numa_nodes} == before


def test_interleave_spreads_huge_pages_and_a_peer_sees_the_same(numa_nodes, huge_pool):
    for n in numa_nodes:
        huge_pool.reserve(8, n)
    layout = Layout.of([("w", 8 * MIB2)], MIB2)
    plan = PlacementPlan((PlacementRange("w", 0, 8 * MIB2, "interleave",
                                         tuple(numa_nodes[:2])),), "interleave")
    with BackingFile.create(layout, b"\1" * 32, directory=huge_pool.mount, placement=plan) as f:
        mine = verify(f.mapping, plan).ranges[0].pages_per_node
        # another process: the policy is not on the file, but the pages are
        child = run_python(f"""
            import json
            from numa_engram.store.placement import PlacementPlan, verify
            from numa_engram.store.storage import BackingFile
            with BackingFile.attach({f.path!r}) as peer:
                plan = PlacementPlan.from_dict(peer.header.plan)
                print(json.dumps(verify(peer.mapping, plan).ranges[0].pages_per_node))
        """)
    assert child.returncode == 0, child.stderr
    assert mine == {numa_nodes[0]: 4, numa_nodes[1]: 4}
    assert {int(k): v for k, v in __import__("json").loads(child.stdout).items()} == mine


def test_a_nodes_pool_too_small_is_refused_naming_the_node(numa_nodes, huge_pool):
    small, big = numa_nodes[-1], numa_nodes[0]
    huge_pool.reserve(2, small)
    huge_pool.reserve(16, big)
    before = {n: _node_free(n) for n in numa_nodes}
    layout = Layout.of([("w", 6 * MIB2)], MIB2)
    plan = PlacementPlan((PlacementRange("w", 0, 6 * MIB2, "bind", (small,)),), "node")
    with pytest.raises(CapacityError, match=f"on NUMA node {small}, which has 2 free") as exc:
        BackingFile.create(layout, b"\2" * 32, directory=huge_pool.mount, placement=plan,
                           topology=Topology.detect())
    assert f"node{small}/hugepages/hugepages-2048kB/nr_hugepages" in str(exc.value)
    assert {n: _node_free(n) for n in numa_nodes} == before
    assert not os.listdir(huge_pool.mount)


@pytest.mark.multiproc
def test_a_group_shares_one_hugetlb_copy_placed_on_the_readers_node(tmp_path, numa_nodes,
                                                                    huge_pool):
    for n in numa_nodes:
        huge_pool.reserve(8, n)
    spec = make_spec(ROWS_PER_HEAD)
    ckpt = str(write_raw_checkpoint(tmp_path / "engram.safetensors", spec))
    meet = tmp_path / "meet"
    meet.mkdir()
    results = run_socket_world(2, "share", meet=str(meet), checkpoint=ckpt,
                               rows_per_head=ROWS_PER_HEAD, page_size="2M",
                               directory=huge_pool.mount)
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('traceback') or r}"
        assert not r["torch_imported"], r
        assert r["same_as_source"] and r["lookup_exact"] and r["placement"]["ok"], r
        assert r["kernel_page_size"] == MIB2
    assert len({r["digest"] for r in results}) == 1
