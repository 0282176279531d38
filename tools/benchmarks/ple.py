"""Qwen4-Exp PLE row lookups against numpy take."""

from __future__ import annotations

import numpy as np

from .harness import best_interleaved, close_table, fill_random, page_sizes, rotating_id_sets, turns
from .serving import LAYER_PAUSE_S, SERVING_TOKENS


def _ple_table(table_gib: float, page: str, rng):
    """A Qwen4-Exp-shaped PLE layer (16 heads of 160 FP8 bytes, one fp32
    scale) of about ``table_gib``, on node 0, random bytes in every row."""
    from numa_engram.model.ple import PLESpec
    from numa_engram.tables.pletable import SharedPLETable

    base = max(1000, int(table_gib * 2**30) // 160 // 16)
    spec = PLESpec(layer_ids=[1], ple_embed_dim=2560, vocab_size=151_936, eos_token_id=2,
                   ngram_vocab_size_base=base)
    table = SharedPLETable.create(spec, 1, mode="independent", placement="node:0",
                                  page_size=page)
    fill_random(table.weights, rng)  # no checkpoint: the table stays writable
    return spec, table


def _ple_variants(spec, table, tokens: int, rng) -> dict:
    """Each PLE lookup of ``tokens`` tokens x 16 heads, on rotating id sets,
    the table's rows' own (``rows.lookup``: what the table's wrapper adds
    is the difference), and numpy take of the same FP8 rows into a
    preallocated output."""
    import torch

    from numa_engram.model.plehashing import ple_ids

    sets = [rng.integers(0, spec.rows(1), (tokens, spec.n_heads))
            for _ in range(rotating_id_sets(tokens, spec.n_heads, spec.row_bytes))]
    flats = [ids.reshape(-1) for ids in sets]
    gathered = np.empty((tokens * spec.n_heads, spec.row_bytes), np.uint8)
    out = torch.empty((tokens, spec.n_heads, spec.head_dim), dtype=torch.bfloat16)
    prepared = table.prepare_out(torch.empty_like(out))
    streams = [rng.integers(0, spec.vocab_size, tokens) for _ in range(len(sets))]
    turn = [0]

    def nxt() -> int:
        turn[0] += 1
        return turn[0] % len(sets)
    return {
        "lookup(ids) bf16": lambda: table.lookup(sets[nxt()]),
        "lookup(ids, out=)": lambda: table.lookup(sets[nxt()], out),
        "out=prepare_out()": lambda: table.lookup(sets[nxt()], prepared),
        "packed": lambda: table.lookup_packed(sets[nxt()]),
        # the table's rows without its wrapper (the open check, the failure count)
        "rows.lookup(ids)": lambda: table.rows.lookup(sets[nxt()]),
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
    pages = page_sizes(table_gib)
    for page in pages:
        spec, table = _ple_table(table_gib, page, rng)
        print(f"== PLE lookups: {table.backing_bytes / 2**30:.2f} GiB layer on {page} pages, "
              f"{spec.n_heads} heads of {spec.row_bytes} FP8 bytes; time in us, ratio to "
              "numpy take")
        for tokens in tokens_list:
            fns = _ple_variants(spec, table, tokens, rng)
            best = best_interleaved(fns, turns(fns, repeat, pause_s=LAYER_PAUSE_S),
                                    LAYER_PAUSE_S)
            if tokens == tokens_list[0]:
                print("  tokens  " + "  ".join(f"{n:>20}" for n in best))
            take = best["numpy take"]
            print(f"  {tokens:6d}  " + "  ".join(
                f"{t * 1e6:10.1f} ({t / take:5.2f}x)" for t in best.values()))
        close_table(table)
