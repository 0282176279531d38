"""The DP-sharded exchange per step, counts gathered against counts given,
across spawned gloo members."""

from __future__ import annotations

import os

import numpy as np

from .harness import best_interleaved, fill_random, rotating_id_sets

DP_SLOTS = (1, 8, 64, 256)


def _dp_member(rank: int, world: int, port: int, table_gib: float, slots: tuple[int, ...],
               results) -> None:
    """One EDP member (a spawned process, gloo on 127.0.0.1): its head slice
    of a V4-shaped layer, then per slot size the DP-sharded lookup with the
    counts gathered and with the counts given, and the member's own local
    lookup of its heads (no exchange), turns interleaved in the same order
    in every member, id sets rotated."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from numa_engram import EngramSpec, SharedEngramTable
    from numa_engram.runtime.dpsharded import DPShardedLookup, ShardedHeads

    dist.init_process_group("gloo", rank=rank, world_size=world)
    per_head = max(1000, int(table_gib * 2**30) // 264 // 24)
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    heads = ShardedHeads.of(spec, 1, 1, world, 0)
    rng = np.random.default_rng(rank)
    table = SharedEngramTable.create(spec, 1, heads.members[rank], mode="independent")
    fill_random(table.weights, rng)
    table.scales[:] = rng.integers(110, 130, table.scales.shape, dtype=np.uint8)
    sharded = DPShardedLookup(table, heads, rank, None, max_tokens=max(slots))
    for slot in slots:
        best = _dp_slot_times(sharded, table, slot, world, spec, rng)
        if rank == 0:
            results.put((world, slot, best))
    dist.barrier()
    table.close()
    dist.destroy_process_group()


def _dp_slot_times(sharded, table, slot: int, world: int, spec, rng) -> dict:
    """One slot size's best times, in the same seeded turn order in every
    member (their collectives pair up)."""
    n_sets = rotating_id_sets(slot, 24 // world, spec.row_bytes)
    sets = list(rng.integers(0, np.asarray(spec.bucket_sizes(1)), (n_sets, slot, 24)))
    turn = [0]

    def ids() -> np.ndarray:
        turn[0] += 1
        return sets[turn[0] % n_sets]
    fns = {"counts gathered": lambda: sharded.lookup(ids()),
           "counts given": lambda: sharded.lookup(ids(), counts=[slot] * world),
           "local heads only": lambda: table.lookup(ids())}
    return best_interleaved(fns, 400 if slot <= 8 else 100 if slot <= 64 else 40)


def bench_dp_sharded(members: tuple[int, ...] = (2, 4), table_gib: float = 0.5,
                     slots: tuple[int, ...] = DP_SLOTS) -> None:
    """The DP-sharded exchange per step for slots of 1-256 tokens: counts
    gathered (two collectives) against counts given (vLLM's
    num_tokens_across_dp: one collective each way), and the member's own
    heads looked up locally (what the exchange adds to)."""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"== DP-sharded lookups: {table_gib:.1f} GiB layer (24 heads) split over the EDP "
          "members, time per step in us (member 0)")
    print("  members  tokens   counts gathered      counts given   local heads only   "
          "given/gathered")
    for world in members:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        results = ctx.Queue()
        procs = [ctx.Process(target=_dp_member, args=(r, world, port, table_gib, slots, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for _ in slots:
            w, slot, best = results.get(timeout=600)
            g, c, local = (best[k] * 1e6 for k in ("counts gathered", "counts given",
                                                   "local heads only"))
            print(f"  {w:7d}  {slot:6d}   {g:12.1f}      {c:12.1f}      {local:12.1f}      "
                  f"{c / g:5.2f}x")
        for p in procs:
            p.join(120)
