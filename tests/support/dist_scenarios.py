"""Scenarios run by tests/support/dist_harness.py in each spawned rank."""

import hashlib
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import synthetic_layer
from numa_engram.groups.group import TorchGroup, sharing_groups
from numa_engram.host import hugepages
from numa_engram.host.procfs import smaps
from numa_engram.lookup.cpu import reference_lookup
from numa_engram.model.hashing import ngram_hashes
from numa_engram.model.sharding import WorldLayout

from .socket_scenarios import LAYER, make_spec


class collectives_forbidden:
    """Make every torch.distributed collective raise while active."""

    NAMES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
             "broadcast_object_list", "all_reduce", "all_to_all", "barrier")

    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in self.NAMES}

        def forbidden(*args, **kwargs):
            raise AssertionError("a collective was called on the lookup path")
        for n in self.NAMES:
            setattr(dist, n, forbidden)

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def share(rank, world, *, tp, dp, mode, checkpoint, rows_per_head, socket_of=None,
          page_size="4K", directory="/dev/shm"):
    spec = make_spec(rows_per_head)
    layout = WorldLayout(tp=tp, dp=dp, gpus_per_host=tp * dp)
    group = sharing_groups(layout, timeout_s=60, socket_of=socket_of, directory=directory)
    tp_rank = rank % tp
    shard = shard_heads(spec.bucket_sizes(LAYER), tp, tp_rank)
    table = SharedEngramTable.create(spec, LAYER, shard, group=group, mode=mode,
                                     checkpoint=checkpoint, placement="gpu-local",
                                     page_size=page_size, directory=directory)
    w_all, s_all = synthetic_layer(spec, LAYER)
    same = (np.array_equal(table.weights, w_all[shard.row_start:shard.row_end])
            and np.array_equal(table.scales, s_all[shard.row_start:shard.row_end]))
    ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, 300), LAYER)
    ids[::7, :] = -1
    with collectives_forbidden():  # shared mode: no DP collective on the lookup path
        got = table.lookup(ids)
    want = reference_lookup(table.weights, table.scales, ids, head_start=shard.head_start,
                            bucket_sizes=spec.bucket_sizes(LAYER)[shard.head_start:
                                                                  shard.head_end])
    exact = np.array_equal(got.view(torch.int16).numpy(), want.view(torch.int16).numpy())
    dist.barrier()  # everyone mapped and touched: measure while all are alive
    mem = smaps("self", "numa-engram-")
    pss, rss = mem.pss, mem.rss
    huge_in_use = hugepages.bytes_in_use()
    report = table.mode_report()
    digest = hashlib.sha256(table.weights.tobytes() + table.scales.tobytes()).hexdigest()
    path_gone = not os.path.exists(table.path)
    placement = table.placement_report().to_dict()
    dist.barrier()
    table.close()
    return {"same_as_source": same, "lookup_exact": exact, "pss": pss, "rss": rss,
            "digest": digest, "path_gone": path_gone, "report": report,
            "backing_bytes": table.backing_bytes, "placement": placement,
            "kernel_page_size": mem.page_size, "huge_in_use": huge_in_use}


def _whole_table_on_world(spec, timeout_s, mode="dp_shared", **kwargs):
    """One shard holding every head, shared by the whole world group."""
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    return SharedEngramTable.create(spec, LAYER, shard, group=TorchGroup(None, timeout_s),
                                    mode=mode, timeout_s=timeout_s, **kwargs)


def peer_never_joins(rank, world):
    if rank == world - 1:
        time.sleep(5)  # arrives only after the others gave up (2 s), with margin
        return {}
    try:
        _whole_table_on_world(make_spec(200), 2)
    finally:
        _store_outlives_the_roll_call(rank, world - 1)
    return {}


def _store_outlives_the_roll_call(rank, waiting):
    """Rank 0 keeps the rendezvous store up until ranks 1..waiting-1 have
    read it: a rank 0 that failed first and exited would take the store with
    it, and the others could then only say 'unknown' (a race, not the
    behaviour under test)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    if rank != 0:
        store.set(f"test/read-done/{rank}", "1")
        return
    store.wait([f"test/read-done/{r}" for r in range(1, waiting)], timedelta(seconds=60))


def leader_killed(rank, world):
    import numa_engram.groups.steps as steps

    if rank == 0:
        def die(step):
            if step == "after-create":
                os.kill(os.getpid(), signal.SIGKILL)
        steps.STEP_HOOK = die
    _whole_table_on_world(make_spec(200), 10)
    return {}


def small_tmpfs(rank, world, *, directory, mode):
    t = _whole_table_on_world(make_spec(2000), 30, mode=mode, directory=directory)
    report = t.mode_report()
    t.close()
    return {"report": report}


def fingerprint_differs(rank, world):
    _whole_table_on_world(make_spec(200, seed=1 if rank == 2 else 0), 30)
    return {}


def other_uid(rank, world):
    if rank == 1:
        os.setuid(65534)
    _whole_table_on_world(make_spec(200), 30)
    return {}


def share_placed(rank, world, *, tp, dp):
    """TP shard r bound to NUMA node r; every member reports where pages are."""
    spec = make_spec(3000)
    layout = WorldLayout(tp=tp, dp=dp, gpus_per_host=tp * dp)
    group = sharing_groups(layout, timeout_s=600)
    tp_rank = rank % tp
    shard = shard_heads(spec.bucket_sizes(LAYER), tp, tp_rank)
    table = SharedEngramTable.create(spec, LAYER, shard, group=group, mode="dp_shared",
                                     placement=f"node:{tp_rank}", timeout_s=600)
    report = table.placement_report().to_dict()
    mode = table.mode_report()
    dist.barrier()
    table.close()
    return {"placement": report, "mode": mode}


def dp_sharded(rank, world, *, tp, dp, counts, n_head_per_ngram, max_ngram, max_tokens,
               given_counts=False):
    """DP-sharded lookups: every replica's rows bit-exact with the reference
    over the whole table, including an idle replica and an all-DEAD one."""
    from numa_engram.lookup.cpu import reference_lookup
    from numa_engram.runtime.dpsharded import DPShardedLookup, ShardedHeads

    spec = EngramSpec.small(rows_per_head=96, n_head_per_ngram=n_head_per_ngram, head_dim=64,
                            max_ngram_size=max_ngram)  # primes 97 and up, like vLLM's test
    layout = WorldLayout(tp=tp, dp=dp, gpus_per_host=tp * dp)
    group = sharing_groups(layout, timeout_s=60)  # the node-local EDP group
    tp_rank, dp_rank = layout.coords(rank)
    edp, edp_rank = group.size, group.rank
    heads = ShardedHeads.of(spec, LAYER, tp, edp, tp_rank)
    table = SharedEngramTable.create(spec, LAYER, heads.members[edp_rank], mode="independent")
    w_all, s_all = synthetic_layer(spec, LAYER, raw=True)
    offset = heads.members[edp_rank].row_start
    n = heads.members[edp_rank].num_rows
    np.copyto(table.weights, w_all[offset:offset + n])
    np.copyto(table.scales, s_all[offset:offset + n])
    rng = np.random.default_rng(100 + rank)
    ids = ngram_hashes(spec, rng.integers(0, 1000, counts[dp_rank]), LAYER)
    if dp_rank == 2:
        ids[:] = -1  # a replica whose ids are all DEAD
    sharded = DPShardedLookup(table, heads, edp_rank, group.process_group, max_tokens=max_tokens)
    # the replicas' counts as a serving stack knows them (this EDP group's, in EDP order)
    edp_counts = [counts[layout.coords(r)[1]] for r in group.ranks]
    got = sharded.lookup(ids, counts=edp_counts if given_counts else None)
    sizes = spec.bucket_sizes(LAYER)
    want = reference_lookup(w_all[heads.members[0].row_start:heads.members[-1].row_end],
                            s_all[heads.members[0].row_start:heads.members[-1].row_end], ids,
                            head_start=heads.head_start,
                            bucket_sizes=sizes[heads.head_start:heads.head_end])
    exact = got.shape == want.shape and np.array_equal(got.view(torch.int16).numpy(),
                                                        want.view(torch.int16).numpy())
    report = sharded.mode_report()
    wrong = None
    if given_counts:  # a count that disagrees with the ids: every member refuses
        from numa_engram.errors import LookupIdError

        lying = list(edp_counts)
        lying[-1] += 1
        try:
            sharded.lookup(ids, counts=lying)
        except LookupIdError as exc:
            wrong = str(exc)
        again = sharded.lookup(ids, counts=edp_counts)  # the group is still in step
        exact = exact and np.array_equal(again.view(torch.int16).numpy(),
                                         want.view(torch.int16).numpy())
    table.close()
    return {"exact": bool(exact), "shape": list(got.shape), "report": report, "wrong": wrong,
            "owned": [
        m.num_heads for m in heads.members]}


# ------------------------------------------------- reliability scenarios --

def _hook(rank, victim, point, action):
    """Step hook: at `point` of the protocol, `victim` kills or stops itself."""
    import numa_engram.groups.steps as steps

    if rank != victim:
        return

    fired = []

    def hook(step):
        if step == point and not fired:  # once: a resumed member goes on
            fired.append(step)
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    steps.STEP_HOOK = hook


def fault(rank, world, *, victim, point, action, bound_s, checkpoint):
    """The fault matrix: one member killed or stopped at one protocol step."""
    _hook(rank, victim, point, action)
    spec = make_spec(1000)
    t = _whole_table_on_world(spec, bound_s, checkpoint=checkpoint)
    exact = bool(np.array_equal(t.weights, synthetic_layer(spec, LAYER)[0]))
    t.close()
    return {"exact": exact}


def other_shard(rank, world):
    """Rank 1 asks for another TP shard than the leader (same spec)."""
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(LAYER), 2, 1 if rank == 1 else 0)
    SharedEngramTable.create(spec, LAYER, shard, group=TorchGroup(None, 30), mode="dp_shared")
    return {}


def other_page_size(rank, world, *, directory):
    """Rank 1 asks for 2 MiB pages, the leader for 4 KiB ones."""
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    SharedEngramTable.create(spec, LAYER, shard, group=TorchGroup(None, 30), mode="dp_shared",
                             page_size="2M" if rank == 1 else "4K",
                             directory=directory if rank == 1 else "/dev/shm")
    return {}


def split_load(rank, world, *, checkpoint, fail_rank=None, error="foreign"):
    """The whole table on one sharing group with a checkpoint: who loaded how
    much (the progress slots), and whether the rows are exact; ``fail_rank``
    raises in the middle of its part (``error``: a foreign OSError, our
    CheckpointError, or ``truncate``: it cuts the checkpoint file before
    its load, a real truncation the others may or may not meet)."""
    import numa_engram.groups.steps as steps
    from numa_engram.errors import CheckpointError
    from numa_engram.tables.loading import DONE

    if rank == fail_rank:
        def hook(step):
            if error == "truncate" and step == "before-load":
                os.truncate(checkpoint, os.path.getsize(checkpoint) // 2)
            elif error != "truncate" and step == "load-progress":
                raise (OSError(5, f"disk gone under rank {rank}") if error == "foreign" else
                       CheckpointError(f"bad rows under rank {rank}"))
        steps.STEP_HOOK = hook
    spec = make_spec(1000)
    t0 = time.monotonic()
    try:
        t = _whole_table_on_world(spec, 30, checkpoint=checkpoint, load_threads=2)
    except Exception as exc:
        return {"raised": type(exc).__name__, "text": str(exc), "seconds": time.monotonic() - t0}
    slots = [v for v in t._backing.read_progress() if v]
    exact = bool(np.array_equal(t.weights, synthetic_layer(spec, LAYER)[0]) and
                 np.array_equal(t.scales, synthetic_layer(spec, LAYER)[1]))
    sealed = not t.weights.flags.writeable
    t.close()
    return {"raised": None, "exact": exact, "done": all(v & DONE for v in slots),
            "bytes": [v & ~DONE for v in slots], "sealed": sealed,
            "row_bytes": spec.rows(LAYER) * spec.row_bytes}


def other_mode(rank, world):
    _whole_table_on_world(make_spec(200), 30, mode="independent" if rank == 2 else "dp_shared")
    return {}


def peer_raises(rank, world, *, error):
    """Members fail while mapping: a SyscallError on one, RuntimeErrors on two."""
    import errno

    import numa_engram.tables.protocol as protocol
    from numa_engram.errors import SyscallError

    def boom(*args, **kwargs):
        if error == "syscall":
            raise SyscallError("mmap", errno.ENOMEM, "length=1")
        raise RuntimeError(f"not ours, rank {rank}")
    if (error == "syscall" and rank == 1) or (error == "foreign" and rank in (1, 2)):
        protocol.peer_attach = boom
    try:
        _whole_table_on_world(make_spec(200), 30)
    except Exception as exc:
        return {"raised": type(exc).__name__, "text": str(exc),
                "failures": [list(f) for f in getattr(exc, "failures", [])],
                "errno": getattr(exc, "errno", None), "call": getattr(exc, "call", None),
                "is_oserror": isinstance(exc, OSError)}
    return {"raised": None}


def peer_stops_itself(rank, world, *, bound_s):
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    _whole_table_on_world(make_spec(200), bound_s)
    return {}


def slow_load(rank, world, *, bound_s, checkpoint, pause_s):
    """A healthy load longer than timeout_s: the leader makes progress."""
    import numa_engram.groups.steps as steps

    if rank == 0:
        steps.STEP_HOOK = lambda step: time.sleep(pause_s) if step == "load-progress" \
            else None
    t0 = time.monotonic()
    t = _whole_table_on_world(make_spec(4000), bound_s, checkpoint=checkpoint)
    took = time.monotonic() - t0
    writable = bool(t.weights.flags.writeable)
    t.close()
    return {"took": took, "writable": writable}


def load_from(rank, world, *, checkpoint):
    _whole_table_on_world(make_spec(200), 30, checkpoint=checkpoint)
    return {}


def memory_fallback(rank, world, *, handover_root, room):
    """auto where the members cannot share (a hand-over root too deep for a
    socket's path): independent copies only if they fit."""
    from numa_engram.store import fdhandover

    os.environ[fdhandover.ROOT_ENV] = handover_root
    rows_per_head = int(room * 0.6) // (8 * 132)
    t = _whole_table_on_world(make_spec(rows_per_head), 60, mode="auto")
    t.close()
    return {}


def _sharded_member(rank, world):
    """This member's head slice of a small layer (TP 1, EDP = the world),
    filled from the synthetic layer, and its DP-sharded lookup over the
    world group: (spec, table, whole weights, whole scales, lookup)."""
    from numa_engram.runtime.dpsharded import DPShardedLookup, ShardedHeads

    spec = EngramSpec.small(rows_per_head=96, n_head_per_ngram=4, head_dim=64)
    heads = ShardedHeads.of(spec, LAYER, 1, world, 0)
    table = SharedEngramTable.create(spec, LAYER, heads.members[rank], mode="independent")
    w_all, s_all = synthetic_layer(spec, LAYER, raw=True)
    mine = heads.members[rank]
    np.copyto(table.weights, w_all[mine.row_start:mine.row_end])
    np.copyto(table.scales, s_all[mine.row_start:mine.row_end])
    return spec, table, w_all, s_all, DPShardedLookup(table, heads, rank, None)


def dp_sharded_bad_id(rank, world):
    """One member passes a bad id: all raise at once; the next lookup works."""
    from numa_engram.errors import LookupIdError

    spec, table, w_all, s_all, sharded = _sharded_member(rank, world)
    ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, 50), LAYER)
    bad = ids.copy()
    if rank == 1:
        bad[7, 3] = 10**9
    t0 = time.monotonic()
    try:
        sharded.lookup(bad)
        first = None
    except LookupIdError as exc:
        first = str(exc)
    took = time.monotonic() - t0
    got = sharded.lookup(ids)
    want = reference_lookup(w_all, s_all, ids, head_start=0,
                            bucket_sizes=spec.bucket_sizes(LAYER))
    exact = bool(np.array_equal(got.view(torch.int16).numpy(), want.view(torch.int16).numpy()))
    global_rows = np.where(ids >= 0, ids + spec.head_offsets(LAYER), -1).astype(np.int32)
    got = sharded.lookup(global_rows, id_format="global")
    exact &= bool(np.array_equal(got.view(torch.int16).numpy(), want.view(torch.int16).numpy()))
    table.close()
    return {"first": first, "took": took, "exact": exact}


GUARD = 0xA5


def _guarded_bf16(shape, pad=4096):
    """A BF16 view of ``shape`` amid guard bytes, and a check that they are intact."""
    n = 2 * int(np.prod(shape))
    whole = torch.full((n + 2 * pad,), GUARD, dtype=torch.uint8)
    view = whole[pad:pad + n].view(torch.bfloat16).view(shape)

    def intact():
        raw = whole.numpy()
        return bool((raw[:pad] == GUARD).all() and (raw[pad + n:] == GUARD).all())
    return view, intact


def dp_sharded_guards(rank, world):
    """The DP-sharded exchange writes its receive buffer, its result and a
    caller's ``out=`` and not a byte around them; a wrong ``out`` in one
    member fails every member before any exchange, and the group goes on."""
    from numa_engram.errors import LookupIdError

    spec, table, w_all, s_all, sharded = _sharded_member(rank, world)
    counts = [7, 12][:world]
    ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, counts[rank]), LAYER)
    want = reference_lookup(w_all, s_all, ids, head_start=0,
                            bucket_sizes=spec.bucket_sizes(LAYER)).view(torch.int16)
    shape = (counts[rank], sharded.heads.head_end - sharded.heads.head_start, spec.head_dim)
    result = {}
    for given in (None, counts):
        out, intact = _guarded_bf16(shape)
        got = sharded.lookup(ids, counts=given, out=out)
        result[f"out given={given is not None}"] = bool(
            got.data_ptr() == out.data_ptr() and torch.equal(got.view(torch.int16), want)
            and intact())
    # the exchange's own buffers (receive and result) handed out amid guards
    checks = []
    pool_take = sharded._outputs.take

    def guarded_take(shape):
        view, intact = _guarded_bf16(shape)
        checks.append(intact)
        return view, view.view(torch.int16).numpy()
    sharded._outputs.take = guarded_take
    got = sharded.lookup(ids)
    sharded._outputs.take = pool_take
    result["internal"] = bool(torch.equal(got.view(torch.int16), want) and len(checks) == 2
                              and all(c() for c in checks))
    # member 1's out is a token short: it gets a ValueError, the others a
    # LookupIdError, nothing is written around it, the next lookup is exact
    refusals = []
    for given in (None, counts):
        short = (shape[0] - (rank == 1),) + shape[1:]
        out, intact = _guarded_bf16(short)
        try:
            sharded.lookup(ids, counts=given, out=out)
            refusals.append(None)
        except (ValueError, LookupIdError) as exc:
            refusals.append([type(exc).__name__, str(exc), intact()])
        again = sharded.lookup(ids, counts=given)
        result[f"again given={given is not None}"] = bool(
            torch.equal(again.view(torch.int16), want))
    table.close()
    return {"exact": result, "refusals": refusals}


# ------------------------------------------------- deployment scenarios --

def share_on_hosts(rank, world, *, tp, mode, checkpoint, rows_per_head, directory="/dev/shm"):
    """Groups formed from measured identities on simulated hosts."""
    spec = make_spec(rows_per_head)
    tp_rank = rank % tp
    group = sharing_groups(tp_rank=tp_rank, directory=directory, timeout_s=60)
    shard = shard_heads(spec.bucket_sizes(LAYER), tp, tp_rank)
    table = SharedEngramTable.create(spec, LAYER, shard, group=group, mode=mode,
                                     checkpoint=checkpoint, directory=directory, timeout_s=60)
    w_all, s_all = synthetic_layer(spec, LAYER)
    exact = bool(np.array_equal(table.weights, w_all[shard.row_start:shard.row_end]) and
                 np.array_equal(table.scales, s_all[shard.row_start:shard.row_end]))
    dist.barrier()
    pss = smaps("self", "numa-engram-").pss
    report = table.mode_report()
    dist.barrier()
    table.close()
    return {"group": list(group.ranks), "identity": group.identity, "report": report,
            "pss": pss, "exact": exact, "backing_bytes": table.backing_bytes,
            "hostname": os.uname().nodename}


def world_group_across_hosts(rank, world, *, mode):
    """One group over the whole world although ranks sit on two hosts."""
    t = _whole_table_on_world(make_spec(200), 30, mode=mode)
    report = t.mode_report()
    t.close()
    return {"report": report}


class FakeCoordinator:
    """vLLM's GroupCoordinator surface over a real gloo group."""

    def __init__(self, ranks):
        self.cpu_group = dist.new_group(list(ranks), backend="gloo")
        self.ranks = list(ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())
        self.world_size = len(self.ranks)

    def broadcast_object(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


def coordinator_group(rank, world):
    """A serving stack's coordinator passed as the group; then DP-sharded
    lookups over what sharing_groups returns."""
    from numa_engram.runtime.dpsharded import DPShardedLookup, ShardedHeads

    coord = FakeCoordinator(range(world))
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    t = SharedEngramTable.create(spec, LAYER, shard, group=coord, mode="dp_shared", timeout_s=30)
    report = t.mode_report()
    t.close()
    group = sharing_groups(tp_rank=0, timeout_s=30)
    heads = ShardedHeads.of(spec, LAYER, 1, group.size, 0)
    own = SharedEngramTable.create(spec, LAYER, heads.members[group.rank], mode="independent")
    w_all, s_all = synthetic_layer(spec, LAYER, raw=True)
    mine = heads.members[group.rank]
    np.copyto(own.weights, w_all[mine.row_start:mine.row_end])
    np.copyto(own.scales, s_all[mine.row_start:mine.row_end])
    ids = ngram_hashes(spec, np.random.default_rng(rank).integers(0, 1000, 40), LAYER)
    got = DPShardedLookup(own, heads, group.rank, group).lookup(ids)
    want = reference_lookup(w_all, s_all, ids, head_start=0,
                            bucket_sizes=spec.bucket_sizes(LAYER))
    own.close()
    return {"report": report, "exact": bool(np.array_equal(
        got.view(torch.int16).numpy(), want.view(torch.int16).numpy()))}


def replace_during_load(rank, world, *, checkpoint, other, replacer):
    """``replacer`` swaps the checkpoint for another version (os.replace)
    just before its own load: no member may build a table from two versions."""
    import numa_engram.groups.steps as steps

    if rank == replacer:
        steps.STEP_HOOK = lambda step: step == "before-load" and os.replace(other,
                                                                                checkpoint)
    t0 = time.monotonic()
    try:
        t = _whole_table_on_world(make_spec(1000), 20, checkpoint=checkpoint, load_threads=2)
    except Exception as exc:
        return {"raised": type(exc).__name__, "text": str(exc),
                "seconds": time.monotonic() - t0}
    t.close()
    return {"raised": None}


def other_placement(rank, world, *, placement):
    """Rank 1 passes ``placement``, the others the default (None: gpu-local)."""
    t = _whole_table_on_world(make_spec(200), 30, placement=placement if rank == 1 else None)
    policy = t.plan.policy
    t.close()
    return {"policy": policy}


def groups_limited(rank, world, *, gpus_per_host=None, within=None):
    """sharing_groups on one machine, limited by a layout or within= groups."""
    layout = None if gpus_per_host is None else WorldLayout(tp=1, dp=world,
                                                            gpus_per_host=gpus_per_host)
    group = sharing_groups(layout, tp_rank=0, within=within, timeout_s=30)
    dist.barrier()  # rank 0 keeps the store the other groups rendezvous through
    return {"group": list(group.ranks)}


def scraped_metrics(rank, world):
    """A shared table in each of 2 ranks, each serving its own metrics port;
    rank 0 scrapes every rank's endpoint (see test_metrics)."""
    import urllib.request

    from numa_engram.errors import LookupIdError, PrefetchError
    from numa_engram.lookup.prefetch import PrefetchScheduler
    from numa_engram.metrics import EngramCollector, serve_metrics

    spec = EngramSpec.small(rows_per_head=400)
    table = SharedEngramTable.create(spec, LAYER, shard_heads(spec.bucket_sizes(LAYER), 1, 0),
                                     group=TorchGroup(None, 60), mode="dp_shared")
    ids = np.zeros((5, spec.n_hash_cols), np.int64)
    for _ in range(3):
        table.lookup(ids)
    bad = ids.copy()
    bad[0, 0] = 10**6
    try:
        table.lookup(bad)
    except LookupIdError:
        pass

    def slow(hash_ids, out):
        time.sleep(0.3)
        return out.zero_()
    sched = PrefetchScheduler({LAYER: slow}, {LAYER: (4, spec.head_dim)}, max_tokens=8)
    sched.submit(LAYER, ids)
    try:
        sched.wait(LAYER, timeout_s=0.01)
    except PrefetchError:
        sched.wait(LAYER)  # still in flight: waited again
    collector = EngramCollector(tables=[table], schedulers=[sched],
                                labels={"rank": rank, "replica": rank})
    server = serve_metrics(collector, 0)
    ports = [None] * world
    dist.all_gather_object(ports, server.server_port)
    texts = []
    if rank == 0:
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                texts.append(r.read().decode())
    dist.barrier()  # every endpoint stays up until rank 0 has scraped it
    server.shutdown()
    sched.close()
    table.close()
    return {"texts": texts, "table_bytes": table.backing_bytes}


def group_progress(rank, world, *, checkpoint):
    """The leader's progress callback while the others' parts are slower:
    it keeps moving after the leader's own part, up to the whole table."""
    import numa_engram.groups.steps as steps

    if rank != 0:  # the other loaders pause after their first chunk, long
        # enough for the leader's own part under any load: it waits on theirs
        paused = []

        def pause_once(step):
            if step == "load-progress" and not paused:
                paused.append(step)
                time.sleep(2.0)
        steps.STEP_HOOK = pause_once
    seen = []
    t = _whole_table_on_world(make_spec(1000), 60, checkpoint=checkpoint, load_threads=1,
                              shared_load=True,
                              progress=(lambda done, total: seen.append((done, total)))
                              if rank == 0 else None)
    own = [v & ~(1 << 63) for v in t._backing.read_progress()][0]
    t.close()
    return {"seen": seen, "own": own}
