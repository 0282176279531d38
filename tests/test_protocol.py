"""The create protocol across real processes (tables/protocol.py, steps.py, membership.py): every
member ends the same way whatever fails where, within the timeout, errors named as themselves."""

import os
import signal

import numpy as np
import pytest

from numa_engram import SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import synthetic_layer, write_synthetic_checkpoint
from numa_engram.store import fdhandover
from numa_engram.store.gc import gc_stale_files

from .conftest import shm_files
from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world, same_failure
from .support.dist_scenarios import LAYER, make_spec
from .support.threadworld import Fault, run_threads
from .test_memfd_sharing import runtime_dir  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(1000)))



@pytest.mark.multiproc
def test_member_asking_for_another_shard_fails_everywhere():
    results = run_world(3, scenarios.other_shard)
    same_failure(results, "SpecMismatchError", "rank 1 asked for layer 1, heads [4, 8)")
    assert "the leader (rank 0) for layer 1, heads [0, 4)" in results[0]["message"]


LEADER_POINTS = ("before-join", "after-create", "after-map", "after-unlink", "load-progress",
                 "before-ready", "after-ready")


PEER_POINTS = ("before-join", "after-decide", "before-map", "after-map", "before-load",
               "before-ready", "after-ready")


FAULTS = [(0, p, a) for p in LEADER_POINTS for a in ("kill", "stop")] + \
         [(2, p, a) for p in PEER_POINTS for a in ("kill", "stop")]



def _whole_table(spec, group, timeout_s, checkpoint):
    """(load_threads=1: the member's own thread reaches "load-progress")"""
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    return SharedEngramTable.create(spec, LAYER, shard, group=group, mode="dp_shared",
                                    timeout_s=timeout_s, checkpoint=checkpoint, load_threads=1)


@pytest.mark.slow  # (each case waits out a timeout or two: ~1 s)
@pytest.mark.parametrize("victim, point, action", FAULTS,
                         ids=[f"{'leader' if v == 0 else 'peer'}-{a}-{p}" for v, p, a in FAULTS])
@pytest.mark.usefixtures("runtime_dir")
def test_fault_matrix(victim, point, action, ckpt):
    """A member killed or stopped at each protocol step (members are threads
    meeting in memory): every surviving member ends the same way within
    timeout_s + 5 s, a stopped one resumed later ends like them, gc then
    leaves /dev/shm clean, and no hand-over directory is left."""
    timeout_s, spec = 0.5, make_spec(1000)
    before = shm_files()
    expected = synthetic_layer(spec, LAYER)[0]

    def member(rank, world):
        t = _whole_table(spec, world.group(rank, timeout_s), timeout_s, ckpt)
        try:
            return {"exact": bool(np.array_equal(t.weights, expected))}
        finally:
            t.close()
    fault = Fault(victim, point, action)
    results = run_threads(3, member, fault=fault)
    assert fault.reached.is_set(), f"member {victim} never reached {point!r}"
    _ended_alike(results, victim, action, timeout_s + 5)
    if action == "kill":
        assert results[victim]["error_type"] == "Vanished", results[victim]
    gc_stale_files()
    assert not shm_files() - before
    assert not os.listdir(os.environ[fdhandover.ROOT_ENV])


def _ended_alike(results, victim, action, bound_s):
    """Every surviving member (a stopped one resumed included) ended the
    same way, each but the victim within ``bound_s``; the ones that
    succeeded hold exact rows."""
    survivors = [r for r in results if r["rank"] != victim or action == "stop"]
    ends = {(r["ok"], r.get("error_type")) for r in survivors}
    assert len(ends) == 1, [(r["rank"], r["ok"], r.get("error_type"), r.get("message"))
                            for r in survivors]
    for r in results:
        if r["rank"] != victim:
            assert r["seconds"] < bound_s, r
        if r["ok"]:
            assert r["exact"]


# a real process killed at the steps that leave a file behind, and one
# stopped and resumed (SIGSTOP, SIGCONT): what threads cannot show (a
# SIGKILL runs no cleanup; a stopped process holds its gloo sockets open)
PROCESS_FAULTS = [(0, "after-create", "kill"), (0, "after-map", "kill"),
                  (2, "after-map", "kill"), (2, "before-load", "stop")]


@pytest.mark.multiproc
@pytest.mark.parametrize("victim, point, action", PROCESS_FAULTS,
                         ids=[f"{'leader' if v == 0 else 'peer'}-{a}-{p}"
                              for v, p, a in PROCESS_FAULTS])
@pytest.mark.usefixtures("runtime_dir")
def test_fault_in_a_real_process(victim, point, action, ckpt):
    """As the matrix, with processes: every surviving member ends the same
    way within timeout_s + 10 s; a killed one leaves nothing in /dev/shm
    (a memfd), and its socket goes with the survivors' hand-over directory."""
    timeout_s = 2
    before = shm_files()
    results = run_world(3, scenarios.fault, timeout_s=90, pg_timeout_s=120, resume_stopped=True,
                        victim=victim, point=point, action=action, bound_s=timeout_s,
                        checkpoint=ckpt)
    _ended_alike(results, victim, action, timeout_s + 10)
    if action == "kill":
        assert results[victim]["exitcode"] == -signal.SIGKILL
    else:
        assert results[victim]["resumed"]
    gc_stale_files()
    assert not shm_files() - before
    assert not os.listdir(os.environ[fdhandover.ROOT_ENV])



@pytest.mark.multiproc
def test_timeout_bounds_collectives_not_the_process_group():
    """A stopped peer, a 40 s process-group timeout, create(timeout_s=3)."""
    results = run_world(3, scenarios.peer_stops_itself, timeout_s=90, pg_timeout_s=40, bound_s=3)
    same_failure(results, "GroupTimeout", "step 'join'", ranks={0, 1})
    assert all(r["seconds"] < 3 + 10 for r in results[:2]), [r["seconds"] for r in results]



@pytest.mark.multiproc
def test_syscall_error_on_a_peer_is_raised_as_itself_everywhere():
    results = run_world(3, scenarios.peer_raises, error="syscall")
    for r in results:
        assert r["raised"] == "SyscallError", r
        assert "step 'map' on member 1 (rank 1): mmap failed: ENOMEM" in r["text"], r["text"]
        assert r["failures"] == [[1, 1, "map", "SyscallError", r["failures"][0][4]]]



@pytest.mark.multiproc
def test_foreign_errors_become_member_failure_listing_every_member():
    results = run_world(3, scenarios.peer_raises, error="foreign")
    for r in results:
        assert r["raised"] == "MemberFailure", r
        assert "member 1 (rank 1) RuntimeError: not ours, rank 1" in r["text"]
        assert "member 2 (rank 2) RuntimeError: not ours, rank 2" in r["text"]
        assert [f[0] for f in r["failures"]] == [1, 2]



@pytest.mark.multiproc
def test_members_must_agree_on_the_mode():
    results = run_world(3, scenarios.other_mode)
    same_failure(results, "TopologyError", "rank 2 asked for mode 'independent'")



@pytest.mark.multiproc
def test_placement_disagreement_and_bad_nodes_fail_in_every_member():
    results = run_world(3, scenarios.other_placement, placement="interleave")
    same_failure(results, "SpecMismatchError", "rank 1 asked for placement 'interleave', "
                                                "the leader (rank 0) for 'gpu-local'")
    results = run_world(3, scenarios.other_placement, placement="node:999")
    same_failure(results, "TopologyError", "step 'join' on member 1 (rank 1)")
    assert "999" in results[0]["message"]
    results = run_world(3, scenarios.other_placement, placement="gpu-local")
    assert all(r["ok"] and r["policy"] == "gpu-local" for r in results), results



@pytest.mark.multiproc
def test_a_peers_syscall_error_keeps_its_errno_and_call_everywhere():
    import errno

    results = run_world(3, scenarios.peer_raises, error="syscall")
    for r in results:
        assert r["raised"] == "SyscallError" and r["is_oserror"], r
        assert r["errno"] == errno.ENOMEM and r["call"] == "mmap", r
