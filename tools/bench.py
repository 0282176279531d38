#!/usr/bin/env python3
"""numa_engram benchmarks.  Every number is printed beside a baseline
measured in the same run, as a ratio (the machine is noisy).

    python tools/bench.py [lookup|default-out|serving|hashing|serving-hashing|
                           decode-hashing|dp-sharded|load|prefetch|restart|ple|
                           mapped|cgroup|peers|all]
                          [--table-gib 2] [--quick]

The benchmarks live in tools/benchmarks/, one module per concern, over
one harness (benchmarks/harness.py: interleaved turns, rotated id sets).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cgroup import bench_cgroup  # noqa: E402
from benchmarks.dpsharded import DP_SLOTS, bench_dp_sharded  # noqa: E402
from benchmarks.hashing import bench_decode_hashing, bench_hashing, bench_serving_hashing  # noqa: E402
from benchmarks.lookup import bench_default_out, bench_lookup  # noqa: E402
from benchmarks.mapped import bench_mapped  # noqa: E402
from benchmarks.peers import bench_peers  # noqa: E402
from benchmarks.ple import bench_ple  # noqa: E402
from benchmarks.serving import bench_layer_steps, bench_prefetch, bench_serving  # noqa: E402
from benchmarks.startup import bench_load, bench_restart  # noqa: E402

from numa_engram.bindings import native  # noqa: E402


def _releases(chosen: str) -> tuple[str, ...]:
    """--vllm: 'all' (the plugin's manifest) or the releases named."""
    from numa_engram.integrations.vllm import manifest

    if chosen == "all":
        return tuple(sorted(manifest.RELEASES))
    return tuple(v.strip() for v in chosen.split(",") if v.strip())


def _sizes(chosen: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
    return default if chosen is None else tuple(float(g) for g in chosen.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="?", default="all",
                   choices=["all", "lookup", "default-out", "serving", "hashing",
                            "serving-hashing", "decode-hashing", "dp-sharded", "load",
                            "prefetch", "restart", "ple", "mapped", "cgroup", "peers"])
    p.add_argument("--table-gib", type=float, default=2.0)
    p.add_argument("--load-gib", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--vllm", default="0.31.0",
                   help="restart: the vLLM releases whose Engram (the wheel's, under the test "
                   "harness) the plugin's path is measured on, comma-separated, or 'all'")
    p.add_argument("--restart-gib", default=None,
                   help="restart: table sizes in GiB, comma-separated (default 1,8)")
    p.add_argument("--mapped-gib", default=None,
                   help="mapped: start sizes in GiB, comma-separated (default 1,8)")
    p.add_argument("--corpus", nargs="+", default=None,
                   help="cgroup: text files for the tokenizer and the ids (default: the docs)")
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
        bench_restart((0.05, 0.2) if a.quick else _sizes(a.restart_gib, (1.0, 8.0)),
                      _releases(a.vllm))
    if a.what in ("all", "mapped"):
        # (a size skips itself, saying so, where the host lacks 2.5x its bytes)
        if a.quick:
            bench_mapped((0.05, 0.1), 0.1, 0.1)
        else:
            bench_mapped(_sizes(a.mapped_gib, (1.0, 8.0)), a.table_gib, 1.0)
    if a.what in ("all", "peers"):
        # engramdb-python's fetch and vLLM 0.34's PLE disk offload, where each can be had
        if a.quick:
            bench_peers(0.05, (1, 8), repeat=3)
        else:
            bench_peers(a.table_gib / 2)
    if a.what in ("all", "cgroup"):
        # the cgroup's 25% holds the engine (torch, ~0.3 GiB) too: 4 GiB leaves it room
        if a.quick:
            bench_cgroup(2.0, 1, 600, a.corpus)
        else:
            bench_cgroup(4.0, 2, 6000, a.corpus)


if __name__ == "__main__":
    main()
