"""DP-sharded mode across 4 real processes (gloo on 127.0.0.1), after vLLM's
test contract: bit-exact rows for every replica, an idle replica, an
all-DEAD replica, a padded head column, oversized batches refused."""


import numpy as np
import pytest

from numa_engram import EngramSpec
from numa_engram.errors import LookupIdError
from numa_engram.runtime.dpsharded import ShardedHeads, pad_hash_ids

from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world

pytestmark = pytest.mark.multiproc
COUNTS = [5, 0, 3, 9]  # by DP rank: replica 1 idle, replica 2 all DEAD


@pytest.mark.parametrize("tp, dp", [(1, 4), (2, 2)])
@pytest.mark.parametrize("heads_per_order, orders", [(4, 3), (7, 2)])  # 8 heads, 7 heads
def test_every_replica_gets_exact_rows(tp, dp, heads_per_order, orders):
    results = run_world(4, scenarios.dp_sharded, tp=tp, dp=dp, counts=COUNTS,
                        n_head_per_ngram=heads_per_order, max_ngram=orders, max_tokens=16)
    _check_exact(results, tp, heads_per_order, orders)


@pytest.mark.parametrize("tp, dp", [(1, 4), (2, 2)])
def test_counts_given_by_the_caller_skip_the_count_gather_bit_exact(tp, dp):
    """vLLM's num_tokens_across_dp passed in: the same rows with one
    collective per direction; a count that disagrees with a member's ids is
    refused in every member, which then look up again in step."""
    results = run_world(4, scenarios.dp_sharded, tp=tp, dp=dp, counts=COUNTS, n_head_per_ngram=4,
                        max_ngram=3, max_tokens=16, given_counts=True)
    _check_exact(results, tp, 4, 3)
    for r in results:
        assert r["wrong"] and "counts says EDP members have" in r["wrong"], r
        assert "passed" in r["wrong"]


def _check_exact(results, tp, heads_per_order, orders):
    n_heads = heads_per_order * (orders - 1)
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert r["exact"], r
        dp_rank = r["rank"] // tp
        assert r["shape"][0] == COUNTS[dp_rank]
        assert r["shape"][1] == sum(r["owned"])  # the TP rank's heads, idle or not
        assert r["report"]["mode"] == "dp_sharded" and r["report"]["embedding_dp_size"] == 4 // tp
    if n_heads == 7 and tp == 1:
        assert results[0]["owned"] == [2, 2, 2, 1]  # the last slice is one head short


def test_oversized_batch_fails_in_every_member():
    results = run_world(4, scenarios.dp_sharded, tp=1, dp=4, counts=[5, 0, 3, 20],
                        n_head_per_ngram=4, max_ngram=3, max_tokens=16)
    for r in results:
        assert not r["ok"] and r["error_type"] == "LookupIdError", r
        assert "[5, 0, 3, 20] tokens" in r["message"]


def test_padding_goes_to_the_slot_with_dead_ids():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    padded = pad_hash_ids(ids, 4)
    assert padded.shape == (4, 3) and (padded[2:] == -1).all() and (padded[:2] == ids).all()
    with pytest.raises(LookupIdError, match="do not fit"):
        pad_hash_ids(ids, 1)


def test_sharded_heads_are_tp_major():
    spec = EngramSpec.small(n_head_per_ngram=4)  # 8 heads
    tp1 = ShardedHeads.of(spec, 1, tp=2, edp=2, tp_rank=1)
    assert [(m.head_start, m.head_end) for m in tp1.members] == [(4, 6), (6, 8)]
    assert (tp1.head_start, tp1.head_end) == (4, 8)


@pytest.mark.multiproc
def test_dp_sharded_bad_id_fails_all_at_once_and_the_group_stays_usable():
    results = run_world(2, scenarios.dp_sharded_bad_id)
    for r in results:
        assert r["ok"], r
        assert "EDP member(s) [1]" in r["first"] and r["took"] < 5
        assert r["exact"]
    assert "hash id 1000000000 at token 7, column 3" in results[1]["first"]


@pytest.mark.multiproc
def test_the_exchange_writes_its_buffers_and_out_and_nothing_around_them():
    """Guard bytes around a caller's out= slice and around the exchange's
    own receive and result buffers stay intact; an out= of the wrong shape
    in one member is refused in every member before any row moves."""
    results = run_world(2, scenarios.dp_sharded_guards)
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert all(r["exact"].values()), r["exact"]
    for given in (0, 1):  # counts gathered, counts given
        kind, message, intact = results[1]["refusals"][given]
        assert kind == "ValueError" and "out must be a contiguous CPU bfloat16 tensor" in message
        assert "[12, 8, 64], got torch.bfloat16 [11, 8, 64]" in message and intact
        assert "no rows were exchanged" in message
        kind, message, intact = results[0]["refusals"][given]
        assert kind == "LookupIdError" and "EDP member(s) [1]" in message and intact
