"""Raw lookups against numpy take and a read-only ceiling, and the default
(pooled) output against a caller's buffer."""

from __future__ import annotations

import numpy as np

from numa_engram.bindings import lookupkernel, native

from .harness import best_interleaved, fill_random, filled_table, numpy_take
from .readlimit import read_rows


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
    tables = {name: filled_table(rows, head_dim, page, rng) for name, page in pages.items()}
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

        def fused(threads, w=w, sc=sc, tuning=None, o=out):
            def run():
                lookup_rows(w, sc, sets[nxt()], head_start=0, bucket_sizes=sizes, out=o,
                            threads=threads, tuning=tuning)
            return run
        fns[f"{name} fused1"], fns[f"{name} fused2"] = fused(1), fused(2)
        fns[f"{name} packed1"] = lambda w=w, sc=sc: gather(
            w, sc, sets[nxt()], head_start=0, bucket_sizes=sizes, out=packed)
        fns[f"{name} take"] = lambda w=w, sc=sc: numpy_take(w, sc, flats[nxt()], gathered_w,
                                                       gathered_s)
        fns[f"{name} limit1"] = lambda w=w: read_rows(w, flats[nxt()], 32, 1)
        fns[f"{name} limit2"] = lambda w=w: read_rows(w, flats[nxt()], 32, 2)
        if name == "4K":
            for ahead, hint in ((32, 3), (32, 1), (64, 1), (128, 1), (32, 0)):
                fns[f"4K fused1 prefetch {ahead}/T{3 - hint if hint else 'NTA'}"] = fused(
                    1, tuning=lookupkernel.Tuning(prefetch_ahead=ahead, prefetch_hint=hint))
    best = best_interleaved(fns, 7)
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
    default = lookupkernel.Tuning()
    for key in [k for k in best if "prefetch" in k]:
        print(f"  {key}: {best['4K fused1'] / best[key]:.2f}x the default "
              f"{default.prefetch_ahead} ahead/hint {default.prefetch_hint}")
    print(f"  bit-exact vs reference on a sample: {exact}")




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
        fill_random(table.weights, rng)
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
