"""Capacity and memory accounting.

Measured part: one reader per kernel file (smaps_rollup, numa_maps, per-node
meminfo, statvfs of a tmpfs) and a sum over a set of pids.  PSS, not RSS, is
what tells one shared copy from N private ones.  No torch here.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import native
from .topology import read_node_meminfo, read_online_nodes


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    rss: int
    pss: int
    pss_shmem: int
    shared: int  # Shared_Clean + Shared_Dirty


def read_smaps_rollup(pid: int) -> ProcessMemory:
    """/proc/<pid>/smaps_rollup in bytes."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return ProcessMemory(pid, fields.get("Rss", 0), fields.get("Pss", 0),
                         fields.get("Pss_Shmem", 0),
                         fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0))


def read_mapping_memory(pid: int | str, match: str) -> tuple[int, int]:
    """(Pss, Rss) bytes of pid's mappings whose smaps header line contains
    ``match`` (e.g. the table prefix): what one table costs one process."""
    pss = rss = 0
    take = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0] if line else ""
        if "-" in first and not first.endswith(":"):
            take = match in line
        elif take and first == "Pss:":
            pss += int(line.split()[1]) * 1024
        elif take and first == "Rss:":
            rss += int(line.split()[1]) * 1024
    return pss, rss


def sum_memory(pids: Iterable[int]) -> ProcessMemory:
    """Totals over pids: summed RSS counts a shared table once per process,
    summed PSS counts it once."""
    rows = [read_smaps_rollup(p) for p in pids]
    return ProcessMemory(-1, sum(r.rss for r in rows), sum(r.pss for r in rows),
                         sum(r.pss_shmem for r in rows), sum(r.shared for r in rows))


def read_numa_maps(pid: int, match: str | None = None) -> dict[int, int]:
    """Pages per node of pid's mappings (only pages it has mapped), from
    /proc/<pid>/numa_maps; ``match`` keeps lines containing that text."""
    pages: Counter[int] = Counter()
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        if match is not None and match not in line:
            continue
        for tok in line.split():
            if tok[:1] == "N" and "=" in tok and tok[1:tok.index("=")].isdigit():
                node, count = tok[1:].split("=")
                pages[int(node)] += int(count)
    return dict(sorted(pages.items()))


def node_shmem() -> dict[int, int]:
    """Shmem bytes per NUMA node (nodeN/meminfo)."""
    return {n: read_node_meminfo(n).get("Shmem", 0) for n in read_online_nodes()
            if Path(f"/sys/devices/system/node/node{n}").exists()}


def tmpfs_usage(directory: str = "/dev/shm") -> tuple[int, int]:
    """(used bytes, total bytes) of a tmpfs."""
    free, total = native.statvfs(directory)
    return total - free, total


def pids_of_users(pattern: str) -> list[int]:
    """Pids whose command line contains pattern (for `numa-engram mem`)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pattern in cmd and int(entry) != os.getpid():
                out.append(int(entry))
    return out


# ------------------------------------------------------------ arithmetic --
# Exact bytes from per-shard row counts (prime bucket sizes make W/T only
# approximate).


@dataclass(frozen=True)
class ModeMemory:
    mode: str
    per_rank: dict[int, int]   # bytes each rank's shard(s) occupy (attributed, not PSS)
    per_node: dict[int, int]   # physical bytes on each node (shared copies counted once)

    @property
    def total(self) -> int:
        return sum(self.per_node.values())


def shard_bytes(spec, layer_id: int, num_shards: int, rank: int, row_wise: bool = False) -> int:
    from .sharding import shard_heads, shard_rows

    shard = shard_rows if row_wise else shard_heads
    return shard(spec.bucket_sizes(layer_id), num_shards, rank).num_rows * spec.row_bytes


def mode_memory(spec, mode: str, layout) -> ModeMemory:
    """Host bytes per rank and per node of all Engram layers under a mode."""
    from .sharding import assign

    per_rank: dict[int, int] = {}
    per_node: Counter[int] = Counter()
    holders: set[tuple[int, ...]] = set()
    for rank in range(layout.world_size):
        a = assign(mode, layout, rank)
        size = sum(shard_bytes(spec, layer, a.num_shards, a.shard_index)
                   for layer in spec.layer_ids)
        per_rank[rank] = size
        if a.sharing_group not in holders:  # one physical copy per sharing group
            holders.add(a.sharing_group)
            per_node[layout.node_of(rank)] += size
    return ModeMemory(mode, per_rank, dict(sorted(per_node.items())))


def query_payload(spec, tokens: int, heads: int | None = None) -> int:
    """Bytes of FP8 rows (weights + scales) one layer's lookup reads for
    ``tokens`` tokens over ``heads`` heads (all heads by default)."""
    return tokens * (spec.n_hash_cols if heads is None else heads) * spec.row_bytes


def dequantized_bytes(spec, tokens: int, heads: int | None = None) -> int:
    """Bytes of the BF16 rows a lookup produces."""
    return tokens * (spec.n_hash_cols if heads is None else heads) * spec.head_dim * 2
