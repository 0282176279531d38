"""Loading a checkpoint into a shared table (tables/loading.py, checkpoint.py): split over the
members on the rows' node, bounded by progress not time, refusing a checkpoint that changes."""

import os

import pytest

from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint

from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world, same_failure
from .support.dist_scenarios import make_spec


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(1000)))



@pytest.mark.multiproc
def test_a_slow_but_healthy_load_outlasts_the_timeout(tmp_path):
    path = tmp_path / "c.safetensors"
    write_synthetic_checkpoint(path, make_spec(4000))
    results = run_world(3, scenarios.slow_load, pg_timeout_s=3, bound_s=3, checkpoint=str(path),
                        pause_s=2.0)
    for r in results:
        assert r["ok"], r
        assert r["took"] > 3, "the load must outlast the timeout for this test to mean much"
        assert not r["writable"], "a loaded table is read-only in every member"



@pytest.mark.multiproc
def test_fifo_checkpoint_is_refused_up_front(tmp_path):
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    results = run_world(3, scenarios.load_from, timeout_s=60, checkpoint=str(fifo))
    same_failure(results, "CheckpointError", "is a FIFO, not a regular file")
    assert all(r["seconds"] < 10 for r in results)



def test_load_parts_go_to_the_members_on_the_rows_node():
    from numa_engram.tables.loading import load_parts, loaders_of

    # bound to node 1: the two members there split the rows, the others load nothing
    parts = load_parts(10, [0, 1, 0, 1], (1,), cooperative=True)
    assert parts == [(0, 0), (0, 5), (0, 0), (5, 10)] and loaders_of(parts) == [0, 1, 3]
    assert load_parts(9, [0, 1, 0], None, True) == [(0, 3), (3, 6), (6, 9)]  # interleave
    assert load_parts(9, [0, 0], (1,), True) == [(0, 9), (0, 0)]  # nobody there: the leader
    assert load_parts(9, [0, 0], (0,), False) == [(0, 9), (0, 0)]  # one loading thread



def test_every_member_loads_its_part_and_the_rows_are_exact(ckpt):
    results = run_world(3, scenarios.split_load, checkpoint=ckpt)
    assert all(r["ok"] and r["raised"] is None for r in results), results
    for r in results:
        assert r["exact"] and r["done"] and r["sealed"]
        # three loaders (all on this host's one node), a third of the rows each
        assert len(r["bytes"]) == 3 and sum(r["bytes"]) == r["row_bytes"]
        assert max(r["bytes"]) - min(r["bytes"]) <= 2 * r["row_bytes"] // 1000



def test_a_loader_failing_mid_part_fails_every_member_at_once(ckpt):
    results = run_world(3, scenarios.split_load, checkpoint=ckpt, fail_rank=2)
    assert all(r["ok"] for r in results), results
    assert len({r["raised"] for r in results}) == 1 and results[0]["raised"], results
    assert all("disk gone under rank 2" in r["text"] for r in results)
    assert all(r["seconds"] < 20 for r in results), results  # FAILED ends the waits, no timeout



@pytest.fixture
def two_versions(tmp_path):
    """A checkpoint and another version of it (another seed, same spec)."""
    path, other = tmp_path / "c.safetensors", tmp_path / "c-v2.safetensors"
    write_synthetic_checkpoint(path, make_spec(1000), seed=0)
    write_synthetic_checkpoint(other, make_spec(1000), seed=1)
    return str(path), str(other)



@pytest.mark.multiproc
@pytest.mark.parametrize("replacer", [0, 2], ids=["leader", "peer-loader"])
def test_a_checkpoint_replaced_during_the_load_fails_every_member(two_versions, replacer):
    path, other = two_versions
    results = run_world(3, scenarios.replace_during_load, checkpoint=path, other=other,
                        replacer=replacer)
    for r in results:
        assert r["ok"] and r["raised"] == "CheckpointError", r
        assert "changed since the checkpoint was resolved" in r["text"], r["text"]
        assert r["seconds"] < 20, r



@pytest.mark.multiproc
def test_every_member_refuses_a_truncated_checkpoint_naming_file_and_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_synthetic_checkpoint(path, make_spec(200))
    os.truncate(path, os.path.getsize(path) - 100)
    results = run_world(3, scenarios.load_from, timeout_s=60, checkpoint=str(path))
    same_failure(results, "CheckpointError", f"{path}: tensor ")
    for r in results:
        assert "needs bytes up to" in r["message"] and "truncated or corrupt" in r["message"]
        assert "step 'decide'" in r["message"], r["message"]  # before anything was allocated
        assert r["seconds"] < 30



@pytest.mark.multiproc
@pytest.mark.parametrize("error, cls", [("foreign", "MemberFailure"),
                                        ("checkpoint", "CheckpointError"),
                                        ("truncate", "CheckpointError")])
def test_a_split_load_fails_with_the_class_of_the_member_that_failed(tmp_path, error, cls):
    path = tmp_path / "c.safetensors"
    write_synthetic_checkpoint(path, make_spec(1000))
    results = run_world(3, scenarios.split_load, checkpoint=str(path), fail_rank=2, error=error)
    for r in results:
        assert r["ok"] and r["raised"] == cls, r
        assert r["seconds"] < 20, r


@pytest.mark.multiproc
def test_the_leaders_progress_is_the_groups_to_the_end(ckpt):
    """A split load's progress callback shows every loader's bytes: it goes
    on past the leader's own share while the others finish, to the total."""
    results = run_world(3, scenarios.group_progress, checkpoint=ckpt)
    assert all(r["ok"] for r in results), results
    seen, own = results[0]["seen"], results[0]["own"]
    total = seen[-1][1]
    assert seen[-1][0] == total and own < total
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never goes back
    assert any(own < d < total for d, _ in seen)  # reported while the others loaded


def _family_checkpoint(family, path, seed):
    from numa_engram.checkpoints.synthetic import write_ple_checkpoint

    from .support.checkpoint_scenarios import ENGRAM_ROWS_PER_HEAD, PLE_SPEC

    if family == "engram":
        return str(write_synthetic_checkpoint(path, make_spec(ENGRAM_ROWS_PER_HEAD), seed=seed))
    return str(write_ple_checkpoint(path, PLE_SPEC, seed=seed))


@pytest.mark.multiproc
@pytest.mark.parametrize("damager", [0, 2], ids=["leader", "peer-loader"])
@pytest.mark.parametrize("damage", ["truncate", "replace"])
@pytest.mark.parametrize("family", ["engram", "ple"])
def test_a_checkpoint_damaged_during_a_shared_load_fails_every_member_alike(
        tmp_path, family, damage, damager):
    """One member truncates or replaces the checkpoint just before its part
    of the load: every member fails with a CheckpointError naming the file,
    and no table file is left behind."""
    from .conftest import shm_files
    from .support import checkpoint_scenarios

    path = _family_checkpoint(family, tmp_path / "c.safetensors", seed=0)
    other = _family_checkpoint(family, tmp_path / "c-v2.safetensors", seed=1)
    before = shm_files()
    results = run_world(3, checkpoint_scenarios.damaged_during_load, family=family,
                        checkpoint=path, other=other, damage=damage, damager=damager)
    for r in results:
        assert r["ok"] and r["raised"] == "CheckpointError", r
        assert path in r["text"], r["text"]
    if damage == "replace":
        assert all("changed since the checkpoint was resolved" in r["text"] for r in results)
    assert shm_files() == before


def _family_model(family, path, seed):
    """A model directory of ``family`` (config.json and its checkpoint)."""
    from numa_engram import EngramSpec, write_synthetic_model

    from .support.checkpoint_scenarios import PLE_SPEC
    from .support.ple_scenarios import write_ple_model

    if family == "engram":
        spec = EngramSpec.small(rows_per_head=1000, n_head_per_ngram=4, head_dim=64,
                                max_ngram_size=3)
        return write_synthetic_model(path, spec, seed=seed, shards=1)
    return write_ple_model(path, PLE_SPEC, seed=seed)


@pytest.mark.parametrize("damage", ["truncate", "replace"])
@pytest.mark.parametrize("family", ["engram", "ple"])
def test_a_checkpoint_damaged_while_serve_loads_fails_its_tables_naming_it(
        tmp_path, monkeypatch, family, damage):
    """The table service (``numa-engram serve``'s) loading a model whose
    checkpoint file is truncated or replaced as the first table's rows are
    read: every table it holds ends failed, each error a CheckpointError
    naming the file; the service still answers, and nothing is left in
    /dev/shm or beside the model."""
    from numa_engram.checkpoints import checkpoint, plecheckpoint
    from numa_engram.runtime.modeldirs import open_model_directory
    from numa_engram.service.tableservice import TableService

    from .conftest import shm_files

    model = _family_model(family, tmp_path / "model", seed=0)
    other = _family_model(family, tmp_path / "v2", seed=1)
    [path] = sorted(model.glob("*.safetensors"))
    module, name = (checkpoint, "load_rows") if family == "engram" else \
        (plecheckpoint, "load_ple_rows")
    real, damaged = getattr(module, name), []

    def damage_then_load(*args, **kwargs):
        if not damaged:
            damaged.append(True)
            if damage == "truncate":
                os.truncate(path, os.path.getsize(path) // 2)
            else:
                os.replace(other / path.name, path)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, damage_then_load)
    before, listing = shm_files(), sorted(os.listdir(model))
    service = TableService(open_model_directory(str(model)), str(tmp_path / "s.sock"), tp=2)
    try:
        service.load_all()
        assert damaged and service.tables
        for t in service.tables:
            assert t.state == "failed", (t.layer_id, t.tp_rank, t.state)
            assert "CheckpointError" in t.error and str(path) in t.error, t.error
        assert not service.status()["ready"]
    finally:
        service.stop()
    assert shm_files() == before and sorted(os.listdir(model)) == listing
