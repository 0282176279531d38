import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_engram.errors import TopologyError
from numa_engram.model.sharding import (
    WorldLayout,
    assign,
    locate_rows,
    shard_heads,
    shard_rows,
    valid_head_shard_counts,
)
from numa_engram.model.spec import EngramSpec

SIZES24 = list(EngramSpec(layer_ids=[1], engram_vocab_sizes=[100, 200, 300], max_ngram_size=4,
                          n_head_per_ngram=8, head_dim=32, compressed_vocab_size=50,
                          pad_id=0).bucket_sizes(1))


def test_head_wise_accepts_exactly_the_vllm_counts_for_24_heads():
    accepted = []
    for n in range(1, 65):
        try:
            [shard_heads(SIZES24, n, r) for r in range(n)]
            accepted.append(n)
        except TopologyError as exc:
            assert "no head" in str(exc) and "shard_rows" in str(exc)
    assert accepted == [1, 2, 3, 4, 5, 6, 8, 12, 24] == valid_head_shard_counts(24, 64)


def test_head_wise_shards_partition_heads_and_rows():
    for n in (1, 2, 3, 4, 5, 6, 8, 12, 24):
        shards = [shard_heads(SIZES24, n, r) for r in range(n)]
        assert shards[0].head_start == 0 and shards[-1].head_end == 24
        assert shards[0].row_start == 0 and shards[-1].row_end == sum(SIZES24)
        for a, b in zip(shards, shards[1:]):
            assert a.head_end == b.head_start and a.row_end == b.row_start
        for s in shards:
            assert s.num_rows == sum(SIZES24[s.head_start:s.head_end]) > 0
    s = shard_heads(SIZES24, 5, 4)  # ceil(24/5)=5: last shard has 4 heads
    assert (s.head_start, s.head_end) == (20, 24)


def test_row_wise_covers_every_count_1_to_64_exactly():
    total = sum(SIZES24)
    for n in range(1, 65):
        shards = [shard_rows(SIZES24, n, r) for r in range(n)]
        covered = np.zeros(total, dtype=np.int32)
        for s in shards:
            covered[s.row_start:s.row_end] += 1
            assert s.num_rows == s.row_end - s.row_start > 0
        assert (covered == 1).all(), f"{n} shards leave a gap or overlap"


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30), data=st.data())
def test_locate_rows_inverts_row_wise_shards(sizes, data):
    n = data.draw(st.integers(1, min(64, sum(sizes))))
    heads = len(sizes)
    ids = np.array([[data.draw(st.integers(-1, sizes[h] - 1)) for h in range(heads)]
                    for _ in range(5)])
    shard, local = locate_rows(sizes, n, ids)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    for t in range(5):
        for h in range(heads):
            if ids[t, h] == -1:
                assert shard[t, h] == -1 and local[t, h] == -1
                continue
            info = shard_rows(sizes, n, int(shard[t, h]))
            assert 0 <= local[t, h] < info.num_rows
            assert info.row_start + local[t, h] == ids[t, h] + offsets[h]
            assert info.head_start <= h < info.head_end


def test_edp_groups_follow_gcd_and_node_alignment():
    layout = WorldLayout(tp=2, dp=4, gpus_per_host=8)
    assert layout.edp_size() == 4
    assert layout.edp_group(0) == (0, 2, 4, 6) and layout.edp_group(3) == (1, 3, 5, 7)
    two_nodes = WorldLayout(tp=2, dp=8, gpus_per_host=8)
    assert two_nodes.edp_group(9) == (9, 11, 13, 15)
    assert WorldLayout(tp=3, dp=4, gpus_per_host=8).edp_size() == 1  # TP straddles nodes
    assert WorldLayout(tp=2, dp=6, gpus_per_host=8).edp_size() == 2  # gcd(6, 4)
    assert len(WorldLayout(tp=1, dp=4, gpus_per_host=4).edp_groups()) == 1


def test_a_world_layout_names_hosts_and_refuses_empty_sizes():
    layout = WorldLayout(tp=2, dp=8, gpus_per_host=8)
    assert layout == WorldLayout(2, 8, 8) and layout.host_of(9) == 1
    with pytest.raises(TopologyError, match="must be >= 1"):
        WorldLayout(2, 8, 0)


def test_groups_split_per_socket_for_replicate_per_node():
    layout = WorldLayout(tp=2, dp=4, gpus_per_host=8)
    socket_of = [gpu // 4 for gpu in range(8)]  # GPUs 0-3 on node 0, 4-7 on node 1
    assert layout.edp_group(0) == (0, 2, 4, 6)  # spans both sockets: half the reads remote
    assert layout.edp_group(0, socket_of) == (0, 2) and layout.edp_group(6, socket_of) == (4, 6)
    assert len(layout.edp_groups(socket_of)) == 4
    with pytest.raises(TopologyError, match="names 3 ranks"):
        layout.edp_group(0, [0, 0, 1])


def test_mode_assignments():
    layout = WorldLayout(tp=2, dp=2, gpus_per_host=4)
    shared = assign("dp_shared", layout, 3)
    assert (shared.num_shards, shared.shard_index, shared.embedding_dp_size) == (2, 1, 1)
    assert shared.sharing_group == (1, 3)
    sharded = [assign("dp_sharded", layout, r) for r in range(4)]
    assert [a.shard_index for a in sharded] == [0, 2, 1, 3]  # TP-major: tp*edp + edp_rank
    assert all(a.num_shards == 4 and a.embedding_dp_size == 2 for a in sharded)
    indep = assign("independent", layout, 2)
    assert indep.sharing_group == (2,) and indep.shard_index == 0
    with pytest.raises(TopologyError, match="unknown mode"):
        assign("shared", layout, 0)
