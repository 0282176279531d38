from numa_engram.model.sharding import WorldLayout, shard_heads
from numa_engram.model.spec import EngramSpec
from numa_engram.store.deployment import mode_memory

V4 = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)


def test_200_gib_table_t2_d4_independent_is_4_copies_shared_is_one():
    layout = WorldLayout(tp=2, dp=4, gpus_per_host=8)
    table = V4.table_bytes()
    assert 185 * 2**30 < table < 200 * 2**30
    indep = mode_memory(V4, "independent", layout)
    shared = mode_memory(V4, "dp_shared", layout)
    assert indep.per_host == {0: 4 * table}
    assert shared.per_host == {0: table}
    # exact per rank: each TP rank holds its own head shard's rows, not table / 2
    rank0 = sum(shard_heads(V4.bucket_sizes(layer), 2, 0).num_rows for layer in V4.layer_ids)
    assert shared.per_rank[0] == rank0 * V4.row_bytes
    assert shared.per_rank[0] + shared.per_rank[1] == table
    sharded = mode_memory(V4, "dp_sharded", layout)
    assert sharded.per_host == {0: table}  # 8 shards of 3 heads, one copy in all
    print(f"\n200 GiB-class table, TP2 x DP4 on one node: independent "
          f"{indep.total / 2**30:.1f} GiB, dp_shared {shared.total / 2**30:.1f} GiB")


def test_two_nodes_each_hold_one_shared_copy():
    layout = WorldLayout(tp=2, dp=8, gpus_per_host=8)
    shared = mode_memory(V4, "dp_shared", layout)
    assert shared.per_host == {0: V4.table_bytes(), 1: V4.table_bytes()}


def test_shard_bytes():
    assert V4.shard_bytes(1, 1, 0) == V4.rows(1) * 264
