#!/usr/bin/env python3
"""numa_engram benchmarks.  Every number is printed beside a baseline
measured in the same run, as a ratio (the machine is noisy).

    python tools/bench.py [lookup|default-out|serving|hashing|serving-hashing|load|prefetch|
                           restart|ple|all]
                          [--table-gib 2] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numa_engram.bindings import native  # noqa: E402
from numa_engram.store.fileformat import Layout  # noqa: E402
from numa_engram.store.storage import BackingFile  # noqa: E402


def best_of(fn, repeat=5):
    return best_interleaved({"x": fn}, repeat)["x"]


def best_interleaved(fns: dict, repeat: int = 7, pause_s: float = 0.0) -> dict:
    """Best time of each function, run in turns (each variant once a turn,
    in a new seeded order each turn) so a noisy neighbour slows every
    variant alike instead of whichever ran then, and no variant always
    follows the same one (a fixed order moved an identical configuration by
    6-11%: what ran before it, e.g. a 2-thread call, set its start).
    ``pause_s`` before each call: what a server does between two lookups
    of a table (other layers), long enough that the table's workers are
    asleep; busy, as a server's thread is (an idle CPU comes back with
    cold caches, which a server's does not)."""
    best = {name: float("inf") for name in fns}
    names = list(fns)
    order = random.Random(0)
    for _ in range(repeat):
        order.shuffle(names)
        for name in names:
            if pause_s:
                _busy(pause_s)
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------- lookup --

def _filled_table(rows: int, head_dim: int, page: int, rng) -> BackingFile:
    """A private table of ``rows`` random FP8 rows on pages of ``page`` bytes."""
    layout = Layout.of([("weights", rows * head_dim), ("scales", rows * head_dim // 32)], page)
    f = BackingFile.create(layout, bytes(32), directory=None, threads=2)
    _fill_random(f.region("weights").reshape(rows, head_dim), rng)
    f.region("scales")[:] = 120
    return f


def _fill_random(weights: np.ndarray, rng) -> None:
    """Random FP8 bytes in every row (a 64 Ki-row block repeated: fast, and
    every page is touched)."""
    step = 1 << 16
    block = rng.integers(0, 256, (step, weights.shape[1]), dtype=np.uint8)
    for a in range(0, weights.shape[0], step):
        weights[a:a + step] = block[: min(step, weights.shape[0] - a)]


def bench_lookup(table_gib: float, tokens: int, heads: int = 24, head_dim: int = 256,
                 id_sets: int = 16) -> None:
    """The fused kernel against numpy take and the random-read limit, on
    4 KiB and (where a pool is reserved) 2 MiB pages, packed output, and
    prefetch settings; every call reads the next of ``id_sets`` id sets, so
    no call finds the rows a recent one left in cache."""
    import torch

    from numa_engram.errors import CapacityError
    from numa_engram.host import hugepages
    from numa_engram.lookup.cpu import gather, lookup_rows, reference_lookup
    from numa_engram.lookup.outputs import aligned_empty

    per_head = int(table_gib * 2**30) // (head_dim + head_dim // 32) // heads
    rows, sizes = per_head * heads, [per_head] * heads
    rng = np.random.default_rng(0)
    pages = {"4K": native.PAGE_SIZE}
    try:
        hugepages.check_pool(rows * (head_dim + 8) + (16 << 20), 2 << 20)
        pages["2M"] = 2 << 20
    except CapacityError as exc:
        print(f"  (2M pages skipped: {exc})")
    tables = {name: _filled_table(rows, head_dim, page, rng) for name, page in pages.items()}
    sets = [np.stack([rng.integers(0, per_head, tokens) for _ in range(heads)], 1)
            for _ in range(id_sets)]
    flats = [(ids + np.arange(heads) * per_head).reshape(-1) for ids in sets]
    # every output from numpy's allocator, as numpy take's are (huge pages
    # where THP is on madvise), 64-byte aligned for streaming stores
    shape = (tokens, heads, head_dim)
    out = torch.from_numpy(aligned_empty(tokens * heads * head_dim).reshape(shape)).view(
        torch.bfloat16)
    packed = (aligned_empty(tokens * heads * head_dim, np.uint8).reshape(shape),
              aligned_empty(tokens * heads * head_dim // 32, np.uint8).reshape(
                  tokens, heads, head_dim // 32))
    gathered_w = np.empty((tokens * heads, head_dim), np.uint8)
    gathered_s = np.empty((tokens * heads, head_dim // 32), np.uint8)
    turn = [0]

    def nxt():
        turn[0] += 1
        return turn[0] % id_sets

    fns = {}
    for name, f in tables.items():
        w = f.region("weights").reshape(rows, head_dim)
        sc = f.region("scales").reshape(rows, head_dim // 32)

        def fused(threads, w=w, sc=sc, prefetch=native.DEFAULT_PREFETCH, o=out):
            def run():
                native.tune_prefetch(*prefetch)
                lookup_rows(w, sc, sets[nxt()], head_start=0, bucket_sizes=sizes, out=o,
                            threads=threads)
            return run
        fns[f"{name} fused1"], fns[f"{name} fused2"] = fused(1), fused(2)
        fns[f"{name} packed1"] = lambda w=w, sc=sc: gather(
            w, sc, sets[nxt()], head_start=0, bucket_sizes=sizes, out=packed)
        fns[f"{name} take"] = lambda w=w, sc=sc: _take(w, sc, flats[nxt()], gathered_w,
                                                       gathered_s)
        fns[f"{name} limit1"] = lambda w=w: native.read_rows(w, flats[nxt()], 32, 1)
        fns[f"{name} limit2"] = lambda w=w: native.read_rows(w, flats[nxt()], 32, 2)
        if name == "4K":
            for ahead, hint in ((32, 3), (32, 1), (64, 1), (128, 1), (32, 0)):
                fns[f"4K fused1 prefetch {ahead}/T{3 - hint if hint else 'NTA'}"] = fused(
                    1, prefetch=(ahead, hint))
    best = best_interleaved(fns, 7)
    native.tune_prefetch(*native.DEFAULT_PREFETCH)
    n = tokens * heads
    w4 = tables["4K"].region("weights").reshape(rows, head_dim)
    s4 = tables["4K"].region("scales").reshape(rows, head_dim // 32)
    exact = torch.equal(lookup_rows(w4, s4, sets[0][:256], head_start=0, bucket_sizes=sizes)
                        .view(torch.int16),
                        reference_lookup(w4, s4, sets[0][:256], head_start=0,
                                         bucket_sizes=sizes).view(torch.int16))
    for f in tables.values():
        f.close()
    print(f"== lookup: table {rows * (head_dim + 8) / 2**30:.2f} GiB ({rows / 1e6:.1f} M rows x "
          f"{head_dim + 8} B), {tokens} tokens x {heads} heads = {n / 1e3:.0f} k random rows, "
          f"{id_sets} rotating id sets")
    for name in tables:
        def rate(v, name=name):
            return n / best[f"{name} {v}"] / 1e6
        print(f"  [{name} pages] fused 1 thread {rate('fused1'):6.2f} M rows/s = "
              f"{best[f'{name} limit1'] / best[f'{name} fused1']:.2f} of the random-read limit "
              f"({rate('limit1'):.2f}); 2 threads {rate('fused2'):6.2f} = "
              f"{best[f'{name} limit2'] / best[f'{name} fused2']:.2f} of the limit "
              f"({rate('limit2'):.2f})")
        print(f"  [{name} pages] numpy take {rate('take'):6.2f} M rows/s -> fused(1) / take = "
              f"{best[f'{name} take'] / best[f'{name} fused1']:.2f}x (target >= 1.0); packed FP8 "
              f"{rate('packed1'):6.2f} -> BF16 / packed time "
              f"{best[f'{name} fused1'] / best[f'{name} packed1']:.2f}")
    if "2M" in tables:
        print("  2M vs 4K pages (time ratio 4K / 2M): " + ", ".join(
            f"{v} {best[f'4K {v}'] / best[f'2M {v}']:.2f}x" for v in ("fused1", "fused2", "take")))
    for key in [k for k in best if "prefetch" in k]:
        print(f"  {key}: {best['4K fused1'] / best[key]:.2f}x the default "
              f"{native.DEFAULT_PREFETCH[0]} ahead/hint {native.DEFAULT_PREFETCH[1]}")
    print(f"  bit-exact vs reference on a sample: {exact}")


def _take(w, sc, flat, out_w, out_s) -> None:
    # mode="clip": with out= and the default mode="raise" numpy buffers
    w.take(flat, axis=0, out=out_w, mode="clip")
    sc.take(flat, axis=0, out=out_s, mode="clip")


def bench_default_out(table_gib: float, tokens: int, id_sets: int = 16) -> None:
    """table.lookup(ids) (pooled output) vs lookup(ids, out=buf), turns
    interleaved, each call on the next of many id sets (no row cached by
    the previous call)."""
    import torch

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    per_head = int(table_gib * 2**30) // 264 // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rng = np.random.default_rng(0)
    with SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0)) as table:
        _fill_random(table.weights, rng)
        table.scales[:] = 120
        sets = [np.stack([rng.integers(0, n, tokens) for n in spec.bucket_sizes(1)], 1)
                for _ in range(id_sets)]
        out = torch.empty((tokens, 24, 256), dtype=torch.bfloat16)
        turn = [0]

        def ids():
            turn[0] += 1
            return sets[turn[0] % id_sets]
        best = best_interleaved({"default": lambda: table.lookup(ids()),
                                 "out": lambda: table.lookup(ids(), out=out),
                                 "packed": lambda: table.lookup(ids(), packed=True)}, 15)
    print(f"== lookup output: {tokens} tokens x 24 heads, {table_gib:.1f} GiB table, "
          f"{id_sets} rotating id sets")
    print(f"  lookup(ids)          : {best['default'] * 1e3:7.2f} ms")
    print(f"  lookup(ids, out=buf) : {best['out'] * 1e3:7.2f} ms")
    print(f"  default / out= time  : {best['default'] / best['out']:.2f} (target <= 1.10)")
    print(f"  packed FP8 output    : {best['packed'] * 1e3:7.2f} ms -> BF16 / packed time "
          f"{best['out'] / best['packed']:.2f}x (half the output bytes)")


# --------------------------------------------------------------- serving --

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
    _fill_random(table.weights, rng)
    table.scales[:] = rng.integers(110, 130, table.scales.shape, dtype=np.uint8)
    return spec, table


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where sysfs says none."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as fh:
            text = fh.read().strip()
        sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG"
                     else int(text))
    return max(sizes, default=32 << 20)


def rotating_id_sets(tokens: int, heads: int, row_bytes: int) -> int:
    """How many id sets a variant rotates through so that none finds its
    rows in cache: the sets' rows together are 4x the last-level cache (at
    least 16 sets, at most 65,536)."""
    per_set = tokens * heads * row_bytes
    return max(16, min(1 << 16, -(-4 * _last_level_cache_bytes() // per_set)))


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
    kernel, buffer = table._shard_kernel(), native.ffi.from_buffer(bits)
    one_thread = native.ShardKernel(table._geometry, 1, table.lookup_cpus)

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
        "numpy take": lambda: _take(table.weights, table.scales, flats[nxt()], gathered_w,
                                    gathered_s),
        "bare native": lambda: _bare_native(kernel, sets[nxt()], buffer),
        "bare, 1 thread": lambda: _bare_native(one_thread, sets[nxt()], buffer),
        "prefetch submit+wait": prefetched,
    }, close


# A server's work between two lookups of one table (its other layers): the
# table's workers' spin (NE_POOL_SPIN_NS, 50 us) is over, as it is there.
LAYER_PAUSE_S = 0.0002


def _busy(seconds: float) -> None:
    """Keep this thread busy for ``seconds``."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _turns(fns: dict, least: int, budget_s: float = 1.0, most: int = 2000,
           pause_s: float = 0.0) -> int:
    """Turns for best_interleaved: at least ``least``, more for fast calls
    (a decode step's lookup is tens of us, and this machine's noise is
    larger than that: the best of many turns finds the floor), within about
    ``budget_s`` for all of them."""
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    turn = time.perf_counter() - t0 + pause_s * len(fns)
    return max(least, min(most, int(budget_s / max(turn, 1e-9))))


def _bare_native(kernel, ids, buffer) -> None:
    """The kernel call alone (ids cast, output cast once): the floor of any
    Python around it."""
    address, stride = native.ids_args(ids)
    kernel.run(address, ids.shape[0], stride, False, buffer)


def _prefetch_ratio(best: dict) -> float:
    """Prefetch submit+wait over the faster direct lookup of the same ids
    (the default output or a caller's: the scheduler writes its staging
    buffer, which a direct call could write as fast either way)."""
    return best["prefetch submit+wait"] / min(best["lookup(ids)"], best["lookup(ids, out=)"])


def _page_sizes(table_gib: float) -> list[str]:
    """4K, and 2M where this node's pool can hold a table of ``table_gib``
    (else a line saying why not)."""
    from numa_engram.errors import CapacityError
    from numa_engram.host import hugepages

    try:
        hugepages.check_pool(int(table_gib * 2**30) + (16 << 20), 2 << 20)
    except CapacityError as exc:
        print(f"  (2M pages skipped: {str(exc).splitlines()[0][:160]})")
        return ["4K"]
    return ["4K", "2M"]


def bench_serving(table_gib: float = 2.0, sweep: tuple[float, ...] = (0.5, 2.0, 8.0),
                  tokens_list: tuple[int, ...] = SERVING_TOKENS, repeat: int = 15) -> None:
    """Lookups at the sizes a server asks for (a decode step is 1-256
    tokens): each variant's best of ``repeat`` interleaved
    turns, as a ratio to numpy take of the same rows into preallocated
    outputs, on 4 KiB and (where a pool can be reserved) 2 MiB pages; then
    the same at 64 and 4096 tokens over table sizes."""
    from numa_engram.errors import CapacityError

    rng = np.random.default_rng(0)
    pages = _page_sizes(table_gib)
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
        _close_table(table)
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
        _close_table(table)
        print(f"  {gib:4.1f} GiB: " + ", ".join(cells))


def _ple_table(table_gib: float, page: str, rng):
    """A Qwen4-Exp-shaped PLE layer (16 heads of 160 FP8 bytes, one fp32
    scale) of about ``table_gib``, on node 0, random bytes in every row."""
    from numa_engram.model.ple import PLESpec
    from numa_engram.sharing.pletable import SharedPLETable

    base = max(1000, int(table_gib * 2**30) // 160 // 16)
    spec = PLESpec(layer_ids=[1], ple_embed_dim=2560, vocab_size=151_936, eos_token_id=2,
                   ngram_vocab_size_base=base)
    table = SharedPLETable.create(spec, 1, mode="independent", placement="node:0",
                                  page_size=page)
    _fill_random(table.weights, rng)  # no checkpoint: the table stays writable
    return spec, table


def _ple_variants(spec, table, tokens: int, rng) -> dict:
    """Each PLE lookup of ``tokens`` tokens x 16 heads, on rotating id sets,
    and numpy take of the same FP8 rows into a preallocated output."""
    import torch

    from numa_engram.model.plehashing import ple_ids

    sets = [rng.integers(0, spec.rows(1), (tokens, spec.n_heads))
            for _ in range(rotating_id_sets(tokens, spec.n_heads, spec.row_bytes))]
    flats = [ids.reshape(-1) for ids in sets]
    gathered = np.empty((tokens * spec.n_heads, spec.row_bytes), np.uint8)
    out = torch.empty((tokens, spec.n_heads, spec.head_dim), dtype=torch.bfloat16)
    streams = [rng.integers(0, spec.vocab_size, tokens) for _ in range(len(sets))]
    turn = [0]

    def nxt() -> int:
        turn[0] += 1
        return turn[0] % len(sets)
    return {
        "lookup(ids) bf16": lambda: table.lookup(sets[nxt()]),
        "lookup(ids, out=)": lambda: table.lookup(sets[nxt()], out),
        "packed": lambda: table.lookup_packed(sets[nxt()]),
        "numpy take": lambda: table.weights.take(flats[nxt()], axis=0, out=gathered,
                                                 mode="clip"),
        "ids + lookup(out=)": lambda: table.lookup(ple_ids(spec, [1], streams[nxt()])[:, 0],
                                                   out),
    }


def bench_ple(table_gib: float = 2.0, tokens_list: tuple[int, ...] = SERVING_TOKENS,
              repeat: int = 15) -> None:
    """Qwen4-Exp PLE lookups at serving sizes: each variant's best of
    ``repeat`` interleaved turns (``LAYER_PAUSE_S`` of work before each), as
    a ratio to numpy take of the same FP8 rows, on 4 KiB and (where a pool
    can be reserved) 2 MiB pages; "ids + lookup" hashes the tokens too."""
    rng = np.random.default_rng(0)
    pages = _page_sizes(table_gib)
    for page in pages:
        spec, table = _ple_table(table_gib, page, rng)
        print(f"== PLE lookups: {table.backing_bytes / 2**30:.2f} GiB layer on {page} pages, "
              f"{spec.n_heads} heads of {spec.row_bytes} FP8 bytes; time in us, ratio to "
              "numpy take")
        for tokens in tokens_list:
            fns = _ple_variants(spec, table, tokens, rng)
            best = best_interleaved(fns, _turns(fns, repeat, pause_s=LAYER_PAUSE_S),
                                    LAYER_PAUSE_S)
            if tokens == tokens_list[0]:
                print("  tokens  " + "  ".join(f"{n:>20}" for n in best))
            take = best["numpy take"]
            print(f"  {tokens:6d}  " + "  ".join(
                f"{t * 1e6:10.1f} ({t / take:5.2f}x)" for t in best.values()))
        _close_table(table)


def _rotating(sets: list) -> Callable[[], np.ndarray]:
    """What gives the next of ``sets`` at each call, round and round."""
    turn = iter(range(1 << 62))
    return lambda: sets[next(turn) % len(sets)]


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
            ids = _rotating(list(rng.integers(0, sizes, (n_sets, tokens, len(sizes)))))
            fns = {"one": lambda ids=ids: first.lookup(ids()),
                   "two": lambda ids=ids: (first.lookup(ids()), second.lookup(ids()))}
            best = best_interleaved(fns, _turns(fns, repeat, pause_s=LAYER_PAUSE_S),
                                    LAYER_PAUSE_S)
            print(f"  {tokens:5d} tokens: one layer {best['one'] * 1e6:8.1f} us, two "
                  f"{best['two'] * 1e6:8.1f} us ({best['two'] / best['one']:.2f}x one)")
    finally:
        _close_table(first)
        _close_table(second)


def _serving_best(spec, table, tokens: int, rng, repeat: int,
                  only: tuple[str, ...] | None = None, pause_s: float = LAYER_PAUSE_S) -> dict:
    """Each variant's best time at one size (``only``: these variants), with
    ``pause_s`` of work before each call; its id sets, outputs and
    references to the table go with the call."""
    fns, close = _serving_variants(spec, table, tokens, rng)
    if only:
        fns = {k: fns[k] for k in only}
    try:
        return best_interleaved(fns, _turns(fns, repeat, pause_s=pause_s), pause_s)
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


def _close_table(table) -> None:
    """Close a benchmark table and drop what still maps it (the variants'
    numpy views keep a closed table's pages), so the next table finds its
    node's memory free."""
    import gc

    table.close()
    gc.collect()


# --------------------------------------------------------------- hashing --

def bench_hashing(tokens: int) -> None:
    from numa_engram import EngramSpec, ngram_hashes
    from numa_engram.model.hashing import ngram_hashes_numpy
    from tests.engram_reference import reference_hashes

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    ids = np.random.default_rng(0).integers(0, spec.compressed_vocab_size, size=(1, tokens))
    m, p = spec.multipliers(1), spec.bucket_sizes(1)
    rows = np.ascontiguousarray(ids, dtype=np.int64)
    batches = [np.ascontiguousarray(rows[:, a:a + 8192]) for a in range(0, tokens, 8192)]
    mult, primes = np.asarray(m, np.int64), np.asarray(p, np.int64)
    best = best_interleaved({
        # serving-sized calls (8192 tokens), whose outputs malloc reuses: the
        # compute, not the page faults of a fresh 190 MB output
        "old1": lambda: _each(batches, lambda b: native.ngram_hashes(
            b, spec.pad_id, mult, 4, primes, 8, hardware_division=True)),
        "new1": lambda: _each(batches, lambda b: native.ngram_hashes(
            b, spec.pad_id, mult, 4, primes, 8)),
        "native1": lambda: ngram_hashes(spec, ids, 1),
        "native2": lambda: ngram_hashes(spec, ids, 1, threads=2),
        "numpy": lambda: ngram_hashes_numpy(spec, ids, 1),
        "ref": lambda: reference_hashes(ids, m, p, 4, 8, spec.pad_id)}, 3)
    same = np.array_equal(ngram_hashes(spec, ids, 1), reference_hashes(ids, m, p, 4, 8, 2))
    print(f"== hashing: {tokens / 1e6:.1f} M tokens, 24 hash columns (V4-like spec)")
    for name, label in (("native1", "native, 1 thread"), ("native2", "native, 2 threads"),
                        ("numpy", "vectorised numpy"), ("ref", "reference formula")):
        print(f"  {label:<18}: {tokens / best[name] / 1e6:6.2f} M tokens/s -> "
              f"{best['ref'] / best[name]:.2f}x the reference (target >= 1x)")
    print(f"  reciprocals vs hardware division (native, 1 thread): "
          f"{best['old1'] / best['new1']:.2f}x (target >= 1.8)")
    print(f"  identical to the reference: {same}")


def _each(batches, fn) -> None:
    for batch in batches:
        fn(batch)  # each output dropped at once: malloc hands the next call the same memory


def serving_batch(rng, tokens: int = 8192, requests: int = 64):
    """A packed batch of `requests` requests: mixed prefill chunks and
    1-token decode steps, interleaved in a random order."""
    lengths = rng.multinomial(tokens - requests, np.ones(requests) / requests) + 1
    lengths[: requests // 2] = 1  # half the requests are decode steps
    lengths[requests // 2:] += (tokens - lengths.sum()) // (requests - requests // 2)
    lengths[-1] += tokens - lengths.sum()
    starts = rng.integers(1, 4000, requests) * (lengths == 1)  # decodes continue a history
    slots = np.repeat(np.arange(requests), lengths)
    positions = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)])
    chunks = np.split(np.arange(tokens), np.cumsum(lengths)[:-1])  # each request in order
    rng.shuffle(chunks)  # requests packed in a random order
    order = np.concatenate(chunks)
    return slots[order], positions[order], starts


def bench_serving_hashing(tokens: int = 8192, requests: int = 64) -> None:
    """HashState on a packed batch (all layers) vs ngram_hashes on one row
    of the same length once per layer, one thread each, turns interleaved."""
    from numa_engram import EngramSpec, HashState, ngram_hashes

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.compressed_vocab_size, tokens)
    slots, positions, starts = serving_batch(rng, tokens, requests)
    state = HashState(spec, max_requests=requests)

    for slot, start in enumerate(starts):  # decode steps continue a history
        if start:
            state.restore(slot, int(start), ids[:3])

    def packed():  # commit=False: the state is the same for every turn
        state.hash(ids, slots, positions, commit=False)

    def whole_rows():
        for layer in spec.layer_ids:
            ngram_hashes(spec, ids, layer)
    best = best_interleaved({"packed": packed, "rows": whole_rows}, 9)
    print(f"== serving hashes: packed batch of {tokens} tokens, {requests} requests "
          f"(prefill chunks and decode steps), {len(spec.layer_ids)} layers, 1 thread")
    print(f"  HashState.hash       : {tokens / best['packed'] / 1e6:6.2f} M tokens/s")
    print(f"  ngram_hashes per layer: {tokens / best['rows'] / 1e6:6.2f} M tokens/s")
    print(f"  ratio packed / whole rows: {best['rows'] / best['packed']:.2f} (target >= 0.8)")


def _decode_step_times(spec, n: int, rng, id_sets: int, calls: int) -> dict:
    """Microseconds per call: HashState.hash of one decode token for each of
    n requests, and the native window hashing of the same number of tokens."""
    from numa_engram import HashState

    state = HashState(spec, max_requests=n, token_map=np.arange(129_280) % 99_092)
    history = rng.integers(0, 129_280, (n, 8))
    for slot in range(n):  # each request 8 tokens in
        state.restore(slot, 8, history[slot])
    sets = [rng.integers(0, 129_280, n) for _ in range(id_sets)]
    slots, positions = np.arange(n, dtype=np.int64), np.full(n, 8, dtype=np.int64)
    wins = [rng.integers(0, 99_092, (n, 4)) for _ in range(id_sets)]
    out = np.empty((n, 2, spec.n_hash_cols), dtype=np.int64)
    turn = iter(range(1 << 62))

    def state_calls():
        for _ in range(calls):
            state.hash(sets[next(turn) % id_sets], slots, positions, commit=False)

    def native_calls():
        for _ in range(calls):
            native.hash_window_batch(wins[next(turn) % id_sets], spec.pad_id, state._multipliers,
                                     state._primes, None, spec.n_head_per_ngram, out, 1)
    best = best_interleaved({"state": state_calls, "native": native_calls}, 9)
    return {k: v / calls * 1e6 for k, v in best.items()}


def bench_decode_hashing(requests: tuple[int, ...] = (1, 8, 64, 256), id_sets: int = 16,
                         calls: int = 200) -> None:
    """HashState.hash for one decode token of each of N requests (2 layers,
    commit=False so every call sees the same history) vs the native hashing
    of the same tokens (the window kernel on windows built once): the
    per-call Python and casts are the difference.  Variants interleaved, id
    sets rotated, ``calls`` calls per timing (a call is microseconds)."""
    from numa_engram import EngramSpec

    spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[16_000_000] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    rng = np.random.default_rng(0)
    print("== decode hashing: one token per request, 2 layers, 1 thread")
    print("  requests   HashState.hash   native windows   ratio (goal <= 1.2 at 64)")
    for n in requests:
        us = _decode_step_times(spec, n, rng, id_sets, calls)
        print(f"  {n:8d}   {us['state']:11.2f} us   {us['native']:11.2f} us   "
              f"{us['state'] / us['native']:5.2f}x")


# ------------------------------------------------------------------ load --

def bench_load(gib: float) -> None:
    import torch
    from safetensors.torch import save_file

    from numa_engram import EngramSpec, SharedEngramTable, shard_heads
    from numa_engram.errors import CapacityError
    from numa_engram.host import hugepages
    from numa_engram.sharing.checkpoint import TensorNames

    head_dim = 256
    per_head = int(gib * 2**30) // (head_dim + 8) // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=head_dim, compressed_vocab_size=99092,
                      pad_id=2)
    rows = spec.rows(1)
    shard = shard_heads(spec.bucket_sizes(1), 1, 0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", "/tmp")) as d:
        path = os.path.join(d, "engram.safetensors")
        w_name, s_name = TensorNames().of(1)
        w = torch.randint(0, 256, (rows, head_dim), dtype=torch.uint8)
        s = torch.randint(110, 135, (rows, head_dim // 32), dtype=torch.uint8)
        save_file({w_name: w.view(torch.float8_e4m3fn), s_name: s.view(torch.float8_e8m0fnu)},
                  path)
        raw = os.path.join(d, "raw.bin")
        with open(raw, "wb") as fh:
            fh.write(w.numpy().tobytes())
            fh.write(s.numpy().tobytes())
        del w, s
        size = rows * spec.row_bytes
        layout = Layout.of([("weights", rows * head_dim), ("scales", rows * head_dim // 32)])

        def plain_copy():
            with BackingFile.create(layout, bytes(32), directory=None) as f:
                buf = f.mapping.array(f.layout.regions[0].offset, size)
                with open(raw, "rb") as fh:
                    fh.readinto(memoryview(buf))

        def create(page_size, load_threads):
            # timed from create() to READY: allocate, place, populate, load
            return lambda: SharedEngramTable.create(spec, 1, shard, checkpoint=path,
                                                    page_size=page_size,
                                                    load_threads=load_threads,
                                                    shared_load=load_threads > 1).close()

        variants = {"copy": plain_copy, "old": create("4K", 1), "new 4K": create("4K", 2)}
        try:
            hugepages.check_pool(size + (8 << 20), 2 << 20)
            variants["new 2M"] = create("2M", 2)
        except CapacityError as exc:
            print(f"  (2M pages skipped: {exc})")
        for fn in variants.values():  # warm the page cache and the reserved pages once
            fn()
        best = best_interleaved(variants, 3)
    print(f"== checkpoint load: {size / 2**30:.2f} GiB shard, create() to READY")
    print(f"  plain copy of the same bytes (page-cached file -> fresh table): "
          f"{size / best['copy'] / 2**30:6.2f} GiB/s")
    print(f"  old: 1 thread, 4K pages : {size / best['old'] / 2**30:6.2f} GiB/s")
    for name in [k for k in variants if k.startswith("new")]:
        print(f"  {name}, 2 threads     : {size / best[name] / 2**30:6.2f} GiB/s -> "
              f"{best['old'] / best[name]:.2f}x the old load"
              + (" (target >= 3x)" if "2M" in name else " (no target)"))


# --------------------------------------------------------------- restart --

def _streamed_model(root: str, gib: float):
    """A model directory of one ~gib GiB layer, its checkpoint streamed
    (never the whole table in memory)."""
    from numa_engram import EngramSpec, write_synthetic_model

    per_head = int(gib * 2**30) // (256 + 8) // 24
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=1000, pad_id=2)
    write_synthetic_model(root, spec, raw=True)
    return spec


def _vllm_plugin_times(model: str, sock: str, size: int) -> tuple[float, float | None] | None:
    """vLLM's own Engram (the wheel's, under the test stubs) through the
    plugin: seconds from ``_allocate_weights`` to ready rows (the views
    vLLM's kernel reads) attached from the service at ``sock``, and for a
    cold private table loaded by vLLM's loader; None without vLLM's sources."""
    from tests import vllm_harness as harness

    root, why = harness.wheel_sources()
    if root is None:
        print(f"  (the vLLM plugin's path not measured: {why})")
        return None
    from numa_engram.integrations.vllm import patch

    nv, common = harness.vllm_modules(root)
    patch(nv, common)
    layout = harness.layout_of(common, model)

    def ready(config, load: bool) -> None:
        harness.State.config = config
        emb = nv.Engram._create_embedding(harness.thin_engram(nv), layout, 0)
        if load:
            harness.load_checkpoint(emb, model, layout.layer_ids[0])
        emb._storage()  # the views vLLM's kernel reads
        emb.numa_table.close()
    attached = harness.config(model, additional={"service": sock})
    t_attach = best_of(lambda: ready(attached, False), 5)
    # cold: a private table plus vLLM's loader's copy of each tensor, beside
    # the service's: measured only where that fits in memory
    if _mem_available() < 2.5 * size:
        return t_attach, None
    t_cold = best_of(lambda: ready(harness.config(model), True), 2)
    return t_attach, t_cold


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f
                    if line.startswith("MemAvailable:"))


def _restart_times(gib: float) -> tuple[int, float, float, tuple[float, float] | None]:
    """(table bytes, best cold start, best attach, the vLLM plugin's (attach,
    cold) or None) for a ~gib GiB table."""
    import subprocess
    import sys

    from numa_engram import SharedEngramTable, shard_heads
    from numa_engram.store import serviceclient

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", "/tmp")) as d:
        model = os.path.join(d, "model")
        spec = _streamed_model(model, gib)
        shard = shard_heads(spec.bucket_sizes(1), 1, 0)

        def cold():
            SharedEngramTable.create(spec, 1, shard, checkpoint=model, directory=None).close()
        cold()  # the checkpoint into the page cache, as a restart finds it
        t_cold = best_of(cold, 2)
        sock = os.path.join(d, "run", "engram.sock")
        proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", "serve", model,
                                 "--socket", sock], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            while not (os.path.exists(sock) and serviceclient.status(sock)["ready"]):
                if proc.poll() is not None:
                    raise SystemExit(f"the service exited: {proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
            t_attach = best_of(
                lambda: SharedEngramTable.attach(spec, 1, shard, service=sock).close(), 5)
            plugin = _vllm_plugin_times(model, sock, spec.rows(1) * spec.row_bytes)
        finally:
            proc.terminate()
            proc.wait()
    return spec.rows(1) * spec.row_bytes, t_cold, t_attach, plugin


def bench_restart(sizes: tuple[float, ...] = (1.0, 8.0)) -> None:
    """Cold start (create + load from a page-cached checkpoint) against an
    engine restart that attaches to a table service's ready table."""
    print("== restart: cold create + load vs attach to the table service")
    attach_s = {}
    for gib in sizes:
        size, t_cold, t_attach, plugin = _restart_times(gib)
        attach_s[gib] = t_attach
        print(f"  {size / 2**30:5.2f} GiB: cold {t_cold:7.3f} s ({size / t_cold / 2**30:.2f} "
              f"GiB/s), restart (attach) {t_attach * 1e3:7.3f} ms -> {t_cold / t_attach:,.0f}x "
              "faster (goal >= 50x at the large size)")
        if plugin is not None:
            p_attach, p_cold = plugin
            cold = "cold not measured (not enough memory beside the service)" \
                if p_cold is None else f"{p_cold:7.3f} s cold (create + vLLM's loader) -> " \
                f"{p_cold / p_attach:,.0f}x"
            print(f"  {size / 2**30:5.2f} GiB through vLLM's Engram + the plugin: "
                  f"_allocate_weights to ready rows {p_attach * 1e3:7.3f} ms attached, {cold}")
    small, large = min(attach_s), max(attach_s)
    print(f"  attach time grows {attach_s[large] / attach_s[small]:.2f}x from {small} to {large} "
          "GiB (goal < 2x)")


# -------------------------------------------------------------- prefetch --

# ----------------------------------------------------------- dp-sharded --

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
    from numa_engram.sharing.dpsharded import DPShardedLookup, ShardedHeads

    dist.init_process_group("gloo", rank=rank, world_size=world)
    per_head = max(1000, int(table_gib * 2**30) // 264 // 24)
    spec = EngramSpec(layer_ids=[1], engram_vocab_sizes=[per_head] * 3, max_ngram_size=4,
                      n_head_per_ngram=8, head_dim=256, compressed_vocab_size=99092, pad_id=2)
    heads = ShardedHeads.of(spec, 1, 1, world, 0)
    rng = np.random.default_rng(rank)
    table = SharedEngramTable.create(spec, 1, heads.members[rank], mode="independent")
    _fill_random(table.weights, rng)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="?", default="all",
                   choices=["all", "lookup", "default-out", "serving", "hashing",
                            "serving-hashing", "decode-hashing", "dp-sharded", "load",
                            "prefetch", "restart", "ple"])
    p.add_argument("--table-gib", type=float, default=2.0)
    p.add_argument("--load-gib", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.table_gib, a.load_gib, a.tokens = 0.1, 0.05, 512
    print(f"page size {native.PAGE_SIZE}, {os.cpu_count()} cpus")
    if a.what in ("all", "lookup"):
        bench_lookup(a.table_gib, a.tokens)
    if a.what in ("all", "default-out"):
        bench_default_out(a.table_gib, a.tokens)
    if a.what in ("all", "serving"):
        if a.quick:
            bench_serving(0.1, (0.1,), (1, 64, 1024), repeat=3)
        else:
            bench_serving(a.table_gib)
            bench_layer_steps()
        bench_decode_hashing()
    if a.what in ("all", "ple"):
        if a.quick:
            bench_ple(0.1, (1, 64, 1024), repeat=3)
        else:
            bench_ple(a.table_gib)
    if a.what in ("all", "serving", "dp-sharded"):
        bench_dp_sharded(table_gib=0.1 if a.quick else 0.5,
                         slots=(1, 64) if a.quick else DP_SLOTS)
    if a.what in ("all", "hashing"):
        bench_hashing(100_000 if a.quick else 1_000_000)
    if a.what in ("all", "serving-hashing"):
        bench_serving_hashing()
    if a.what == "decode-hashing":  # (serving runs it too)
        bench_decode_hashing()
    if a.what in ("all", "load"):
        bench_load(a.load_gib)
    if a.what in ("all", "prefetch"):
        bench_prefetch()
    if a.what in ("all", "restart"):
        bench_restart((0.05, 0.2) if a.quick else (1.0, 8.0))


if __name__ == "__main__":
    main()
