"""The DP-shared table across real processes (spawn + gloo on 127.0.0.1)."""

import os

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import synthetic_layer, write_synthetic_checkpoint
from numa_engram.errors import SpecMismatchError, StorageError, TopologyError
from numa_engram.store import fdhandover
from numa_engram.store.gc import gc_stale_files

from .conftest import shm_files
from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world, same_failure
from .support.dist_scenarios import make_spec
from .test_memfd_sharing import runtime_dir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.multiproc
ROWS_PER_HEAD = 4000  # 8 heads x ~4000 rows x 132 B = ~4 MiB per layer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(ROWS_PER_HEAD)))


def _all_ok(results):
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('traceback') or r}"


@pytest.mark.parametrize("tp, dp", [(1, 4), (2, 2)])
def test_dp_shared_one_copy_vs_independent_four(tmp_path, checkpoint, tp, dp):
    shared = run_world(4, scenarios.share, tp=tp, dp=dp, mode="dp_shared",
                       checkpoint=checkpoint, rows_per_head=ROWS_PER_HEAD)
    _all_ok(shared)
    indep = run_world(4, scenarios.share, tp=tp, dp=dp, mode="independent",
                      checkpoint=checkpoint, rows_per_head=ROWS_PER_HEAD)
    _all_ok(indep)
    one_copy = sum(r["backing_bytes"] for r in shared[:tp])  # the TP shards of one replica
    for r in shared + indep:
        assert r["same_as_source"] and r["lookup_exact"]
        assert r["path_gone"], "the backing file must be unlinked once all members mapped"
    for r in shared:
        assert r["report"]["mode"] == "dp_shared" and r["report"]["embedding_dp_size"] == 1
        assert r["report"]["sharing_group"] == [r["rank"] % tp + k * tp for k in range(dp)]
        assert r["placement"]["ok"]
    # identical bytes within each TP shard's sharing group
    for t in range(tp):
        assert len({r["digest"] for r in shared if r["rank"] % tp == t}) == 1
    pss_shared = sum(r["pss"] for r in shared)
    pss_indep = sum(r["pss"] for r in indep)
    print(f"\nTP{tp}xDP{dp}: one copy {one_copy / 2**20:.2f} MiB; sum of PSS: dp_shared "
          f"{pss_shared / 2**20:.2f} MiB ({pss_shared / one_copy:.2f} copies), independent "
          f"{pss_indep / 2**20:.2f} MiB ({pss_indep / one_copy:.2f} copies)")
    assert abs(pss_shared - one_copy) <= 0.05 * one_copy
    assert abs(pss_indep - dp * one_copy) <= 0.05 * dp * one_copy
    assert all(r["report"]["mode"] == "independent" for r in indep)


def test_per_socket_groups_hold_one_copy_per_socket(checkpoint):
    """replicate-per-node: DP replicas on GPUs of two sockets, a copy each."""
    results = run_world(4, scenarios.share, tp=1, dp=4, mode="dp_shared", checkpoint=checkpoint,
                        rows_per_head=ROWS_PER_HEAD, socket_of=[0, 0, 1, 1])
    _all_ok(results)
    assert [r["report"]["sharing_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    one_copy = results[0]["backing_bytes"]
    pss = sum(r["pss"] for r in results)
    assert abs(pss - 2 * one_copy) <= 0.05 * 2 * one_copy
    assert all(r["same_as_source"] and r["lookup_exact"] for r in results)


def test_peer_that_never_joins_times_out_everywhere_naming_it(tmp_path):
    """(the roll call: each member names the one that did not arrive)"""
    results = run_world(4, scenarios.peer_never_joins, timeout_s=40, pg_timeout_s=5)
    same_failure(results, "GroupTimeout", "step 'join'", ranks={0, 1, 2})
    same_failure(results, "GroupTimeout", "member(s) at world rank(s) [3] did not arrive",
                       ranks={0, 1, 2})
    assert all(r["seconds"] < 2 + 10 for r in results[:3]), "no hang past the timeout"
    assert not shm_files()


@pytest.mark.usefixtures("runtime_dir")
def test_leader_killed_after_create_leaves_nothing_behind():
    """The leader SIGKILLed once its memfd is made: the members fail alike,
    no file is in /dev/shm for gc, and the members removed the dead leader's
    socket and the hand-over directory."""
    before = shm_files()
    results = run_world(4, scenarios.leader_killed, timeout_s=90, pg_timeout_s=10)
    assert results[0]["exitcode"] == -9
    same_failure(results, "GroupTimeout", "did not complete", ranks={1, 2, 3})
    assert all(r["seconds"] < 10 + 10 for r in results[1:]), "no hang past the timeout"
    assert not shm_files() - before
    assert not [e for e in gc_stale_files() if e.removed]
    assert not os.listdir(os.environ[fdhandover.ROOT_ENV])


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=512k tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    yield str(mnt)
    os.system(f"umount {mnt}")


@pytest.mark.usefixtures("runtime_dir")
def test_a_tmpfs_too_small_no_longer_limits_a_4k_dp_shared_table(small_tmpfs):
    """On 4 KiB pages the table is a memfd: a 512 KiB tmpfs given as the
    directory holds nothing of a ~1 MiB shared table."""
    results = run_world(4, scenarios.small_tmpfs, directory=small_tmpfs, mode="dp_shared")
    _all_ok(results)
    assert all(r["report"]["mode"] == "dp_shared" and r["report"]["backing_bytes"] > 512 << 10
               for r in results)
    assert not os.listdir(small_tmpfs) and not os.listdir(os.environ[fdhandover.ROOT_ENV])


def test_peer_with_another_spec_fails_everywhere(tmp_path):
    results = run_world(4, scenarios.fingerprint_differs)
    same_failure(results, "SpecMismatchError", "members [2] have another Engram spec")


def test_peer_of_another_uid_is_refused_at_join(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to start a member as another uid")
    results = run_world(4, scenarios.other_uid)
    same_failure(results, "StorageError", "rank 1 runs as uid 65534, the leader as uid 0")


# ------------------------------------------------- single-process checks --

def test_private_table_lives_on_a_memfd_and_close_is_idempotent(tmp_path):
    spec = EngramSpec.small()
    ckpt = write_synthetic_checkpoint(tmp_path / "c.safetensors", spec)
    shard = shard_heads(spec.bucket_sizes(14), 2, 0)
    before = shm_files()
    with SharedEngramTable.create(spec, 14, shard, checkpoint=str(ckpt)) as table:
        assert table.path.startswith("memfd:") and shm_files() == before
        w, _ = synthetic_layer(spec, 14)
        np.testing.assert_array_equal(table.weights, w[shard.row_start:shard.row_end])
        report = table.mode_report()
        assert report["mode"] == "independent" and report["head_end"] == 4
    table.close()
    with pytest.raises(StorageError, match="closed"):
        table.lookup(np.zeros((1, spec.n_hash_cols), np.int64))


def test_attach_by_fd_sees_the_table_and_refuses_an_unfinished_one():
    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with SharedEngramTable.create(spec, 1, shard) as table:
        table.weights[:2] = 7
        fd = table._backing.fd
        peer = SharedEngramTable.attach(spec, 1, shard, fd=fd)
        assert (peer.weights[:2] == 7).all() and not peer.weights.flags.writeable
        ids = np.zeros((3, spec.n_hash_cols), np.int64)
        assert torch_equal(peer.lookup(ids), table.lookup(ids))
        peer.close()
        table._backing.set_state(0)
        with pytest.raises(StorageError, match="not READY"):
            SharedEngramTable.attach(spec, 1, shard, fd=fd)
        with pytest.raises(SpecMismatchError):
            SharedEngramTable.attach(EngramSpec.small(seed=3), 1, shard, fd=fd)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_shard_not_made_by_shard_heads_is_refused():
    spec = EngramSpec.small()
    bad = shard_heads(spec.bucket_sizes(14), 2, 0)
    bad = type(bad)(bad.head_start, bad.head_end, 1, bad.row_end, bad.num_rows - 1)
    with pytest.raises(TopologyError, match="shard_heads"):
        SharedEngramTable.create(spec, 14, bad)


def test_leader_failure_while_creating_is_raised_as_itself():
    from numa_engram.errors import PlacementError
    from numa_engram.store.placement import PlacementPlan, PlacementRange

    spec = EngramSpec.small()
    bad = PlacementPlan((PlacementRange("weights", 4097, 4096, "bind", (0,)),))
    with pytest.raises(PlacementError, match="step 'create'.*not aligned"):
        SharedEngramTable.create(spec, 14, shard_heads(spec.bucket_sizes(14), 1, 0),
                                 placement=bad)


def test_explicit_dp_shared_without_peers_fails_loudly():
    spec = EngramSpec.small()
    with pytest.raises(StorageError, match="one member"):
        SharedEngramTable.create(spec, 14, shard_heads(spec.bucket_sizes(14), 1, 0),
                                 mode="dp_shared")


def test_lookup_of_global_rows_equals_bucket_ids_and_checks_each_head():
    from numa_engram.errors import LookupIdError
    from numa_engram.model.hashing import ngram_hashes

    spec = EngramSpec.small()
    shard = shard_heads(spec.bucket_sizes(14), 2, 1)
    with SharedEngramTable.create(spec, 14, shard) as table:
        w, s = synthetic_layer(spec, 14, raw=True)
        np.copyto(table.weights, w[shard.row_start:shard.row_end])
        np.copyto(table.scales, s[shard.row_start:shard.row_end])
        ids = ngram_hashes(spec, np.random.default_rng(1).integers(0, 1000, 64), 14)
        ids[::5, 5] = -1
        rows = np.where(ids >= 0, ids + spec.head_offsets(14), -1)
        want = table.lookup(ids)
        assert torch_equal(table.lookup(rows, id_format="global"), want)
        assert torch_equal(table.lookup(rows.astype(np.int32), id_format="global"), want)
        bad = rows.copy()
        bad[3, 6] = spec.head_offsets(14)[6] - 1  # the previous head's last row
        with pytest.raises(LookupIdError, match=f"hash id {bad[3, 6]} at token 3, column 6 "
                                                "is outside head 6's global rows"):
            table.lookup(bad, id_format="global")
