"""Raw lookups against numpy take and a read-only ceiling, the default
(pooled) output against a caller's buffer, and a step's layers in one C
call against a call per layer."""

from __future__ import annotations

import numpy as np

from numa_engram.bindings import lookupkernel, native

from .harness import (
    best_interleaved,
    close_table,
    fill_random,
    filled_table,
    numpy_take,
    rotating_id_sets,
    turns,
)
from .ple import _ple_table
from .readlimit import read_rows
from .serving import LAYER_PAUSE_S, _serving_table


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
    bench_step_gather(min(0.25, table_gib / 8))




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


def bench_step_gather(layer_gib: float = 0.25, layers: int = 4,
                      tokens_list: tuple[int, ...] = (1, 8, 64), repeat: int = 15) -> None:
    """A decode step's lookups of ``layers`` Engram layers (V4-shaped: 24
    heads of 256 FP8 bytes) and as many PLE layers (Qwen4-Exp-shaped: 16
    heads of 160), each table ``layer_gib``: one C call for all of them
    (``StepGather``) against one call per layer (each into its staging
    buffer, checked once: ``bind_lookup`` and ``prepare_out``), both against
    numpy take of the same rows, turns interleaved (``LAYER_PAUSE_S`` of
    work before each, as a server's other work), every call on the next of
    its rotating id sets."""
    rng = np.random.default_rng(2)
    engram = [_serving_table(layer_gib, "4K", rng) for _ in range(layers)]
    ple = [_ple_table(layer_gib, "4K", rng) for _ in range(layers)]
    try:
        print(f"== a step's gathers in one C call: {layers} Engram + {layers} PLE layers of "
              f"{layer_gib} GiB (4K pages); time in us, ratio to numpy take of the same rows")
        print(f"  {'tokens':>6}  {'one call':>16}  {f'{2 * layers} calls':>16}  "
              f"{'numpy take':>16}  one call / {2 * layers} calls")
        for tokens in tokens_list:
            fns = _step_variants(engram, ple, tokens, rng)
            best = best_interleaved(fns, turns(fns, repeat, pause_s=LAYER_PAUSE_S),
                                    LAYER_PAUSE_S)
            take = best["numpy take"]
            print(f"  {tokens:6d}  " + "  ".join(
                f"{best[k] * 1e6:8.1f} ({best[k] / take:4.2f}x)"
                for k in ("one call", "per layer", "numpy take"))
                  + f"  {best['one call'] / best['per layer']:.2f}x")
    finally:
        for _, table in (*engram, *ple):
            close_table(table)


def _step_variants(engram, ple, tokens: int, rng) -> dict:
    """``bench_step_gather``'s variants at one size: the step in one call,
    a call per layer, numpy take; every one draws the step's ids alike."""
    import torch

    from numa_engram.lookup.stepgather import StepGather

    pairs, per_layer, takes, sets = [], [], [], []
    for spec, table in engram:
        sizes = np.asarray(spec.bucket_sizes(1))
        n = rotating_id_sets(tokens, len(sizes), spec.row_bytes)
        layer_sets = list(rng.integers(0, sizes, (n, tokens, len(sizes))))
        out = torch.empty((tokens, len(sizes), spec.head_dim), dtype=torch.bfloat16)
        pairs.append((table, out))
        per_layer.append(table.bind_lookup(torch.empty_like(out)))
        gathered = (np.empty((tokens * len(sizes), spec.head_dim), np.uint8),
                    np.empty((tokens * len(sizes), spec.scales_per_row), np.uint8))
        flats = [(ids + spec.head_offsets(1)).reshape(-1) for ids in layer_sets]
        takes.append((table, flats, gathered))
        sets.append(layer_sets)
    for spec, table in ple:
        n = rotating_id_sets(tokens, spec.n_heads, spec.row_bytes)
        layer_sets = list(rng.integers(0, spec.rows(1), (n, tokens, spec.n_heads)))
        out = torch.empty((tokens, spec.n_heads, spec.head_dim), dtype=torch.bfloat16)
        pairs.append((table, out))
        prepared = table.prepare_out(torch.empty_like(out))
        per_layer.append(lambda ids, table=table, prepared=prepared: table.lookup(ids, prepared))
        gathered = np.empty((tokens * spec.n_heads, spec.row_bytes), np.uint8)
        takes.append((table, [ids.reshape(-1) for ids in layer_sets], gathered))
        sets.append(layer_sets)
    step = StepGather(pairs)
    turn = [0]

    def ids() -> list:
        turn[0] += 1
        return [layer_sets[turn[0] % len(layer_sets)] for layer_sets in sets]

    def per_layer_calls() -> None:
        for lookup, layer_ids in zip(per_layer, ids()):
            lookup(layer_ids)

    def take_all() -> None:
        ids()  # (the same draw as the others': the flat rows of this turn's sets)
        for table, flats, gathered in takes:
            flat = flats[turn[0] % len(flats)]
            if isinstance(gathered, tuple):
                numpy_take(table.weights, table.scales, flat, *gathered)
            else:
                table.weights.take(flat, axis=0, out=gathered, mode="clip")
    return {"one call": lambda: step(ids()), "per layer": per_layer_calls,
            "numpy take": take_all}
