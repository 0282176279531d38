"""Scenarios of 4 KiB dp_shared tables handed over as memfds (store/fdhandover.py),
run by tests/support/dist_harness.py in real processes (tests/test_memfd_sharing.py)."""

import hashlib
import os
import signal
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from numa_engram import SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import synthetic_layer
from numa_engram.groups.group import TorchGroup
from numa_engram.host.accounting import tmpfs_usage
from numa_engram.host.procfs import smaps
from numa_engram.lookup.cpu import reference_lookup
from numa_engram.model.hashing import ngram_hashes

from .socket_scenarios import LAYER, make_spec


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _gone(pid, timeout_s=30.0):
    """Wait until ``pid`` is dead (gone, or a zombie its parent has not reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def _digest(table):
    return hashlib.sha256(table.weights.tobytes() + table.scales.tobytes()).hexdigest()


def one_copy(rank, world, *, rows_per_head):
    """The whole world shares one table bigger than /dev/shm: the leader
    writes rows, every member reads them; PSS measured while all map it."""
    spec = make_spec(rows_per_head)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    table = SharedEngramTable.create(spec, LAYER, shard, group=TorchGroup(None, 120),
                                     mode="dp_shared", timeout_s=120)
    if table.leader:
        table.weights[:] = np.arange(table.weights.size, dtype=np.uint64).astype(
            np.uint8).reshape(table.weights.shape)
    dist.barrier()
    mem = smaps("self", "numa-engram-")
    report = table.mode_report()
    _, shm_total = tmpfs_usage("/dev/shm")
    shm_names = [n for n in os.listdir("/dev/shm") if n.startswith("numa-engram-")]
    digest = _digest(table)
    dist.barrier()  # every member measured while all map the table
    table.close()
    return {"pss": mem.pss, "rss": mem.rss, "backing_bytes": table.backing_bytes,
            "digest": digest, "mode": report["mode"], "path": report["backing_path"],
            "shm_total": shm_total, "shm_names": shm_names}


def late_member_and_killed_creator(rank, world, *, checkpoint):
    """World ranks 1..3 create a table (rank 1 leads: the rendezvous store
    is rank 0's, so rank 0 must live); rank 1 is then killed (SIGKILL), the
    members go on serving, rank 0 joins late from the hand-over directory,
    and the last holder to close leaves nothing behind."""
    store = _store()
    wait = timedelta(seconds=60)
    group = dist.new_group([1, 2, 3], backend="gloo")
    spec = make_spec(1000)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    expected = synthetic_layer(spec, LAYER)
    out = {}
    if rank == 0:  # the late member
        store.wait(["test/creator"], wait)
        creator = int(store.get("test/creator"))
        directory = store.get("test/handover").decode()
        out["creator_dead_before_join"] = _gone(creator)
        table = SharedEngramTable.attach(spec, LAYER, shard, peers=directory)
        out["late_exact"] = bool(np.array_equal(table.weights, expected[0]) and
                                 np.array_equal(table.scales, expected[1]))
        out["late_mode"] = table.mode
        out["late_serves"] = table.handover == directory
        store.set("test/late-joined", "1")
        store.wait(["test/closed/2", "test/closed/3"], wait)
        out["dir_kept_by_last_holder"] = os.path.isdir(directory)
        table.close()
        out["dir_gone_after_last"] = not os.path.exists(directory)
        return out
    table = SharedEngramTable.create(spec, LAYER, shard, group=TorchGroup(group, 60),
                                     mode="dp_shared", checkpoint=checkpoint, timeout_s=60)
    if rank == 1:  # the creator: publishes where the table is handed over, then dies
        store.set("test/handover", table.handover)
        store.set("test/creator", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["test/creator"], wait)
    out["creator_dead"] = _gone(int(store.get("test/creator")))
    ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, 300), LAYER)
    got = table.lookup(ids)
    want = reference_lookup(expected[0], expected[1], ids, head_start=0,
                            bucket_sizes=spec.bucket_sizes(LAYER))
    out["serving_exact"] = bool(np.array_equal(got.view(torch.int16).numpy(),
                                               want.view(torch.int16).numpy()))
    store.wait(["test/late-joined"], wait)
    table.close()
    store.set(f"test/closed/{rank}", "1")
    return out
