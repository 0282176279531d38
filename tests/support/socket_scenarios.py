"""Scenarios run by tests/support/socketworld.py in each rank: members meet
through SocketGroup, and nothing here imports torch."""

import hashlib
import json
import os
import signal
import time

import numpy as np

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.checkpoint import DEFAULT_NAMES
from numa_engram.groups.socketgroup import SocketGroup
from numa_engram.host import hugepages
from numa_engram.host.procfs import smaps
from numa_engram.lookup.cpu import gather
from numa_engram.model.hashing import ngram_hashes
from numa_engram.model.sharding import prefix_offsets

LAYER = 1


def make_spec(rows_per_head, seed=0):
    return EngramSpec.small(rows_per_head=rows_per_head, n_head_per_ngram=4, head_dim=128,
                            seed=seed)


def _group(meet, rank, world, timeout_s, name="group"):
    return SocketGroup(os.path.join(meet, f"{name}.sock"), rank, world, timeout_s=timeout_s)


def collectives(rank, world, *, meet):
    with _group(meet, rank, world, 30) as group:
        gathered = group.all_gather({"rank": rank, "pid": os.getpid()}, "hello")
        told = group.broadcast(f"from {os.getpid()}" if rank == 0 else None, "tell")
        group.barrier("done")
        path_gone = not os.path.exists(group.path)
    return {"gathered": gathered, "told": told, "path_gone": path_gone}


def member_fails(rank, world, *, meet, victim, action, bound_s):
    """``victim`` is killed (SIGKILL) or stops itself (SIGSTOP) after
    joining; the others time their next collective."""
    group = _group(meet, rank, world, bound_s)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        group.all_gather(rank, "after-join")
        error = None
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {"elapsed": time.monotonic() - t0, "error": error}


def never_joins(rank, world, *, meet, bound_s):
    if rank == world - 1:
        time.sleep(bound_s + 2)  # arrives after the others gave up
        return {}
    _group(meet, rank, world, bound_s)
    return {}


def mismatched(rank, world, *, meet):
    with _group(meet, rank, world, 30) as group:
        group.all_gather(rank, "load" if rank != 1 else "map")


def other_user(rank, world, *, meet):
    if rank == 0:
        os.umask(0)  # the socket open to anyone: the credentials must refuse
        _group(meet, rank, world, 3)
    else:
        time.sleep(0.2)
        os.setuid(65534)
        _group(meet, rank, world, 3)


def share(rank, world, *, meet, checkpoint, rows_per_head, page_size="4K",
          directory="/dev/shm", placement="gpu-local"):
    """One dp_shared copy of the whole layer (``checkpoint``: one
    safetensors file, write_raw_checkpoint's): each member's rows equal to
    the file's bytes, gathered bit-exact, its memory measured while all map
    it."""
    spec = make_spec(rows_per_head)
    sizes = spec.bucket_sizes(LAYER)
    shard = shard_heads(sizes, 1, 0)
    with _group(meet, rank, world, 60) as group:
        table = SharedEngramTable.create(spec, LAYER, shard, group=group, mode="dp_shared",
                                         checkpoint=checkpoint, placement=placement,
                                         page_size=page_size, directory=directory)
        same = all(np.array_equal(mine, _file_tensor(checkpoint, name).reshape(mine.shape))
                   for mine, name in zip((table.weights, table.scales),
                                         DEFAULT_NAMES.of(LAYER)))
        ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, 300), LAYER)
        ids[::7, :] = -1
        exact = _packed_rows_exact(table, ids, sizes)
        group.barrier("mapped")  # everyone mapped and touched: measure while all are alive
        mem = smaps("self", "numa-engram-")
        result = {"same_as_source": same, "lookup_exact": exact, "pss": mem.pss,
                  "rss": mem.rss, "kernel_page_size": mem.page_size,
                  "huge_in_use": hugepages.bytes_in_use(), "report": table.mode_report(),
                  "digest": hashlib.sha256(table.weights.tobytes() + table.scales.tobytes())
                  .hexdigest(), "placement": table.placement_report().to_dict()}
        group.barrier("measured")
        table.close()
    return result


def _file_tensor(path, name):
    """A tensor's bytes read from a safetensors file by its header alone
    (not through the library's reader, which made the table)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        start, end = json.loads(f.read(length))[name]["data_offsets"]
        f.seek(8 + length + start)
        return np.frombuffer(f.read(end - start), np.uint8)


def _packed_rows_exact(table, ids, sizes):
    """The kernel's rows of ``ids`` from the shared pages, as stored,
    against numpy's indexing (DEAD ids give zero rows)."""
    heads, dim, block = len(sizes), table.weights.shape[1], table.spec.block
    rows = np.empty((len(ids), heads, dim), np.uint8)
    scales = np.empty((len(ids), heads, dim // block), np.uint8)
    gather(table.weights, table.scales, ids, head_start=0, bucket_sizes=sizes,
           out=(rows, scales))
    at = np.where(ids >= 0, ids + prefix_offsets(sizes), 0)
    want_rows, want_scales = table.weights[at], table.scales[at]
    want_rows[ids < 0], want_scales[ids < 0] = 0, 0
    return bool(np.array_equal(rows, want_rows) and np.array_equal(scales, want_scales))


def share_placed(rank, world, *, meet, tp):
    """TP shard r bound to NUMA node r, shared by the ranks of TP rank r;
    every member reports where the pages are."""
    spec = make_spec(3000)
    tp_rank = rank % tp
    ranks = tuple(range(tp_rank, world, tp))
    with SocketGroup(os.path.join(meet, f"tp{tp_rank}.sock"), ranks.index(rank), len(ranks),
                     ranks=ranks, timeout_s=600) as group:
        shard = shard_heads(spec.bucket_sizes(LAYER), tp, tp_rank)
        table = SharedEngramTable.create(spec, LAYER, shard, group=group, mode="dp_shared",
                                         placement=f"node:{tp_rank}", timeout_s=600)
        result = {"placement": table.placement_report().to_dict(),
                  "mode": table.mode_report()}
        group.barrier("reported")
        table.close()
    return result
