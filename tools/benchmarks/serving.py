"""Serving-size lookups (1 to 16,384 tokens) through every path a server
takes, against numpy take; a step of layers; the CPU prefetch's exposed
wait."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from numa_engram.bindings import lookupkernel, native

from .harness import (
    best_interleaved,
    close_table,
    fill_random,
    numpy_take,
    page_sizes,
    rotating,
    rotating_id_sets,
    turns,
)

SERVING_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)


def _serving_table(table_gib: float, page: str, rng):
    """A V4-shaped table (24 heads of 256 FP8 bytes + 8 scales) of about
    ``table_gib``, placed on node 0 as a plan places it (so it has
    lookup_cpus), random bytes in every row."""
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    per_head = max(1000, int(table_gib * 2**30) // 264 // 24)
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    table = SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                     placement="node:0", page_size=page)
    # no checkpoint: the table stays writable for the caller to fill
    fill_random(table.weights, rng)
    table.scales[:] = rng.integers(110, 130, table.scales.shape, dtype=np.uint8)
    return spec, table


def _serving_variants(spec, table, tokens: int, rng,
                      id_sets: int | None = None) -> tuple[dict, Callable[[], None]]:
    """Every variant of one size, each call on the next of ``id_sets`` id
    sets (enough that no call finds a previous call's rows in cache); and
    what closes its prefetch scheduler and kernel after."""
    import torch

    from numa_engram.lookup.outputs import aligned_empty
    from numa_engram.lookup.prefetch import PrefetchScheduler

    sizes = spec.bucket_sizes(1)
    offsets = spec.head_offsets(1)
    id_sets = id_sets or rotating_id_sets(tokens, len(sizes), spec.row_bytes)
    sets = list(rng.integers(0, np.asarray(sizes), (id_sets, tokens, len(sizes))))
    flats = [(ids + offsets).reshape(-1) for ids in sets]
    shape = (tokens, len(sizes), spec.head_dim)
    out = torch.from_numpy(aligned_empty(int(np.prod(shape))).reshape(shape)).view(
        torch.bfloat16)
    bits = out.view(torch.int16).numpy().view(np.uint16)
    gathered_w = np.empty((tokens * len(sizes), spec.head_dim), np.uint8)
    gathered_s = np.empty((tokens * len(sizes), spec.scales_per_row), np.uint8)
    turn = [0]
    sched = PrefetchScheduler({1: table}, {1: (len(sizes), spec.head_dim)}, max_tokens=tokens)
    # the bare calls: the table's kernel, and one bound alike to a single
    # thread on the same CPUs, both made once (as a table makes its own)
    kernel, buffer = table.rows._shard_kernel(), native.ffi.from_buffer(bits)
    one_thread = lookupkernel.ShardKernel(table.rows._geometry, 1, table.lookup_cpus)

    def close() -> None:
        sched.close()
        one_thread.close()

    def nxt() -> int:
        turn[0] += 1
        return turn[0] % id_sets

    def prefetched():
        sched.submit(1, sets[nxt()])
        sched.wait(1)
    return {
        "lookup(ids)": lambda: table.lookup(sets[nxt()]),
        "lookup(ids, out=)": lambda: table.lookup(sets[nxt()], out=out),
        "packed": lambda: table.lookup(sets[nxt()], packed=True),
        "numpy take": lambda: numpy_take(table.weights, table.scales, flats[nxt()], gathered_w,
                                    gathered_s),
        "bare native": lambda: _bare_native(kernel, sets[nxt()], buffer),
        "bare, 1 thread": lambda: _bare_native(one_thread, sets[nxt()], buffer),
        "prefetch submit+wait": prefetched,
    }, close


# A server's work between two lookups of one table (its other layers): the
# table's workers' spin (NE_POOL_SPIN_NS, 50 us) is over, as it is there.
LAYER_PAUSE_S = 0.0002


def _bare_native(kernel, ids, buffer) -> None:
    """The kernel call alone (ids cast, output cast once): the floor of any
    Python around it."""
    address, stride = lookupkernel.ids_args(ids)
    kernel.run(address, ids.shape[0], stride, False, buffer)


def _prefetch_ratio(best: dict) -> float:
    """Prefetch submit+wait over the faster direct lookup of the same ids
    (the default output or a caller's: the scheduler writes its staging
    buffer, which a direct call could write as fast either way)."""
    return best["prefetch submit+wait"] / min(best["lookup(ids)"], best["lookup(ids, out=)"])


def bench_serving(table_gib: float = 2.0, sweep: tuple[float, ...] = (0.5, 2.0, 8.0),
                  tokens_list: tuple[int, ...] = SERVING_TOKENS, repeat: int = 15) -> None:
    """Lookups at the sizes a server asks for (a decode step is 1-256
    tokens): each variant's best of ``repeat`` interleaved
    turns, as a ratio to numpy take of the same rows into preallocated
    outputs, on 4 KiB and (where a pool can be reserved) 2 MiB pages; then
    the same at 64 and 4096 tokens over table sizes."""
    from numa_engram.errors import CapacityError

    rng = np.random.default_rng(0)
    pages = page_sizes(table_gib)
    for page in pages:
        spec, table = _serving_table(table_gib, page, rng)
        print(f"== serving lookups: {table.backing_bytes / 2**30:.2f} GiB table on {page} pages, "
              f"24 heads, lookup_cpus {list(table.lookup_cpus) or 'none'}, "
              f"{table.lookup_threads} thread(s); time in us, ratio to numpy take")
        for tokens in tokens_list:
            best = _serving_best(spec, table, tokens, rng, repeat)
            if tokens == tokens_list[0]:
                print("  tokens  " + "  ".join(f"{n:>20}" for n in best))
            take = best["numpy take"]
            print(f"  {tokens:6d}  " + "  ".join(
                f"{t * 1e6:10.1f} ({t / take:5.2f}x)" for t in best.values())
                + f"   prefetch/direct {_prefetch_ratio(best):.2f}x")
        if 64 in tokens_list and table.lookup_threads > 1:
            print(_awake_line(spec, table, rng, repeat))
        close_table(table)
    print("== table-size sweep (4K pages): lookup(ids) / numpy take")
    for gib in sweep:
        try:
            spec, table = _serving_table(gib, "4K", rng)
        except CapacityError as exc:
            print(f"  {gib:4.1f} GiB: skipped ({str(exc).splitlines()[0][:160]})")
            continue
        cells = []
        for tokens in (64, 4096):
            best = _serving_best(spec, table, tokens, rng, repeat,
                                 only=("lookup(ids)", "numpy take"))
            cells.append(f"{tokens} tokens {best['lookup(ids)'] * 1e6:8.1f} us "
                         f"({best['lookup(ids)'] / best['numpy take']:.2f}x)")
        close_table(table)
        print(f"  {gib:4.1f} GiB: " + ", ".join(cells))


def bench_layer_steps(table_gib: float = 0.5, tokens_list: tuple[int, ...] = (64, 256),
                      repeat: int = 15) -> None:
    """A decode step's lookups of two layers (two tables placed alike, one
    after the other, workers asleep before the step) against one layer's:
    the second finds the workers the first woke (they share them)."""
    rng = np.random.default_rng(1)
    spec, first = _serving_table(table_gib, "4K", rng)
    _, second = _serving_table(table_gib, "4K", rng)
    try:
        sizes = np.asarray(spec.bucket_sizes(1))
        print(f"== a step of two layers: two {table_gib} GiB tables on 4K pages, "
              f"{first.lookup_threads} thread(s) on CPUs {list(first.lookup_cpus)}")
        for tokens in tokens_list:
            n_sets = rotating_id_sets(tokens, len(sizes), spec.row_bytes)
            ids = rotating(list(rng.integers(0, sizes, (n_sets, tokens, len(sizes)))))
            fns = {"one": lambda ids=ids: first.lookup(ids()),
                   "two": lambda ids=ids: (first.lookup(ids()), second.lookup(ids()))}
            best = best_interleaved(fns, turns(fns, repeat, pause_s=LAYER_PAUSE_S),
                                    LAYER_PAUSE_S)
            print(f"  {tokens:5d} tokens: one layer {best['one'] * 1e6:8.1f} us, two "
                  f"{best['two'] * 1e6:8.1f} us ({best['two'] / best['one']:.2f}x one)")
    finally:
        close_table(first)
        close_table(second)


def _serving_best(spec, table, tokens: int, rng, repeat: int,
                  only: tuple[str, ...] | None = None, pause_s: float = LAYER_PAUSE_S) -> dict:
    """Each variant's best time at one size (``only``: these variants), with
    ``pause_s`` of work before each call; its id sets, outputs and
    references to the table go with the call."""
    fns, close = _serving_variants(spec, table, tokens, rng)
    if only:
        fns = {k: fns[k] for k in only}
    try:
        return best_interleaved(fns, turns(fns, repeat, pause_s=pause_s), pause_s)
    finally:
        close()


# Calls this close together find the table's workers still spinning
# (NE_POOL_SPIN_NS, 50 us): what a lookup costs without a worker's wake-up.
AWAKE_PAUSE_S = 0.00002


def _awake_line(spec, table, rng, repeat: int, tokens: int = 64) -> str:
    """lookup(ids) / numpy take at ``tokens`` tokens with the workers awake
    and asleep, interleaved in one run: how much of a lookup is the
    wake-up of a sleeping worker (a futex wake and an IPI: tens of us in a
    VM guest)."""
    only = ("lookup(ids)", "numpy take")
    asleep = _serving_best(spec, table, tokens, rng, repeat, only)
    awake = _serving_best(spec, table, tokens, rng, repeat, only, AWAKE_PAUSE_S)
    return (f"  {tokens} tokens, workers asleep (calls {LAYER_PAUSE_S * 1e6:.0f} us apart) / "
            f"awake ({AWAKE_PAUSE_S * 1e6:.0f} us apart): lookup(ids) "
            f"{asleep['lookup(ids)'] / asleep['numpy take']:.2f}x / "
            f"{awake['lookup(ids)'] / awake['numpy take']:.2f}x numpy take")


def bench_prefetch(lookup_ms: float = 20.0, layer_ms: float = 5.0, layers_before: int = 6) -> None:
    from numa_engram.lookup.prefetch import PrefetchScheduler

    def lookup(ids, out):
        time.sleep(lookup_ms / 1e3)
        return out

    def compute():
        time.sleep(layer_ms / 1e3)

    with PrefetchScheduler({1: lookup}, {1: (1, 1)}, max_tokens=1) as s:
        ids = np.zeros((1, 1), np.int64)
        for _ in range(5):  # prefetch on: submitted before the layers ahead of it
            s.submit(1, ids)
            for _ in range(layers_before):
                compute()
            s.wait(1)
        done = s.stats()[1]
        on = done.exposed_wait_seconds / done.lookups
        t0 = time.perf_counter()
        for _ in range(5):  # prefetch off: looked up when the layer needs it
            s.submit(1, ids)
            s.wait(1)
        off = (time.perf_counter() - t0) / 5
    print(f"== prefetch (CPU backend): lookup {lookup_ms} ms, {layers_before} layers x "
          f"{layer_ms} ms ahead")
    print(f"  exposed wait: on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms; expected on "
          f"~max(0, lookup - lead) = {max(0.0, lookup_ms - layers_before * layer_ms):.2f} ms")
