"""What every benchmark shares: interleaved best-of timing, id sets rotated
past the last-level cache, page sizes this host has, tables filled at
random."""

from __future__ import annotations

import glob
import random
import time
from collections.abc import Callable

import numpy as np

from numa_engram.store.fileformat import Layout
from numa_engram.store.storage import BackingFile


def best_of(fn, repeat=5):
    return best_interleaved({"x": fn}, repeat)["x"]


def best_interleaved(fns: dict, repeat: int = 7, pause_s: float = 0.0,
                     before=None) -> dict:
    """Best time of each function, run in turns (each variant once a turn,
    in a new seeded order each turn) so a noisy neighbour slows every
    variant alike instead of whichever ran then, and no variant always
    follows the same one (a fixed order moved an identical configuration by
    6-11%: what ran before it, e.g. a 2-thread call, set its start).
    ``pause_s`` before each call: what a server does between two lookups
    of a table (other layers), long enough that the table's workers are
    asleep; busy, as a server's thread is (an idle CPU comes back with
    cold caches, which a server's does not).  ``before(name)``: what a
    variant needs before each of its calls (e.g. a file's pages dropped),
    outside the timing."""
    best = {name: float("inf") for name in fns}
    names = list(fns)
    order = random.Random(0)
    for _ in range(repeat):
        order.shuffle(names)
        for name in names:
            if before is not None:
                before(name)
            if pause_s:
                busy(pause_s)
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def filled_table(rows: int, head_dim: int, page: int, rng) -> BackingFile:
    """A private table of ``rows`` random FP8 rows on pages of ``page`` bytes."""
    layout = Layout.of([("weights", rows * head_dim), ("scales", rows * head_dim // 32)], page)
    f = BackingFile.create(layout, bytes(32), directory=None, threads=2)
    fill_random(f.region("weights").reshape(rows, head_dim), rng)
    f.region("scales")[:] = 120
    return f


def fill_random(weights: np.ndarray, rng) -> None:
    """Random FP8 bytes in every row (a 64 Ki-row block repeated: fast, and
    every page is touched)."""
    step = 1 << 16
    block = rng.integers(0, 256, (step, weights.shape[1]), dtype=np.uint8)
    for a in range(0, weights.shape[0], step):
        weights[a:a + step] = block[: min(step, weights.shape[0] - a)]


def last_level_cache_bytes() -> int:
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
    return max(16, min(1 << 16, -(-4 * last_level_cache_bytes() // per_set)))


def busy(seconds: float) -> None:
    """Keep this thread busy for ``seconds``."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def turns(fns: dict, least: int, budget_s: float = 1.0, most: int = 2000,
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


def page_sizes(table_gib: float) -> list[str]:
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


def rotating(sets: list) -> Callable[[], np.ndarray]:
    """What gives the next of ``sets`` at each call, round and round."""
    turn = iter(range(1 << 62))
    return lambda: sets[next(turn) % len(sets)]


def close_table(table) -> None:
    """Close a benchmark table and drop what still maps it (the variants'
    numpy views keep a closed table's pages), so the next table finds its
    node's memory free."""
    import gc

    table.close()
    gc.collect()


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f
                    if line.startswith("MemAvailable:"))


def numpy_take(w, sc, flat, out_w, out_s) -> None:
    # mode="clip": with out= and the default mode="raise" numpy buffers
    w.take(flat, axis=0, out=out_w, mode="clip")
    sc.take(flat, axis=0, out=out_s, mode="clip")
