"""Shard math: head-wise (vLLM's rule), row-wise (for counts head-wise
rejects), the three modes, and the node-local sharing (EDP) groups.

Head-wise: ``part = ceil(n_heads / num_shards)``; shard r owns heads
``[r*part, min((r+1)*part, n_heads))`` and the rows of those heads.
Row-wise: the layer's rows cut into ``num_shards`` contiguous ranges as even
as possible; a (head, bucket) pair maps to (shard, local row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import TopologyError
from ..literals import SHARING_MODES

DEAD_ID = -1


@dataclass(frozen=True)
class ShardInfo:
    head_start: int
    head_end: int
    row_start: int
    row_end: int
    num_rows: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def _check_shard_args(bucket_sizes: Sequence[int], num_shards: int, rank: int) -> None:
    if not bucket_sizes:
        raise TopologyError("no hash heads: bucket_sizes is empty")
    if num_shards < 1:
        raise TopologyError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= rank < num_shards:
        raise TopologyError(f"shard rank {rank} is outside [0, {num_shards})")


def shard_heads(bucket_sizes: Sequence[int], num_shards: int, rank: int) -> ShardInfo:
    """Whole heads per shard (head_dim is never cut); a shard count that
    leaves some shard without a head is refused."""
    _check_shard_args(bucket_sizes, num_shards, rank)
    n_heads = len(bucket_sizes)
    part = math.ceil(n_heads / num_shards)
    if (num_shards - 1) * part >= n_heads:
        ok = valid_head_shard_counts(n_heads)
        raise TopologyError(
            f"{num_shards} head-wise shards of {n_heads} hash heads would leave a shard with no "
            f"head (ceil({n_heads}/{num_shards}) = {part} heads each); use one of {ok} shards "
            "or row-wise sharding (shard_rows)")
    start, end = rank * part, min((rank + 1) * part, n_heads)
    row_start = int(sum(bucket_sizes[:start]))
    row_end = row_start + int(sum(bucket_sizes[start:end]))
    return ShardInfo(start, end, row_start, row_end, row_end - row_start)


def valid_head_shard_counts(n_heads: int, upto: int | None = None) -> list[int]:
    upto = upto or n_heads
    return [s for s in range(1, upto + 1)
            if (s - 1) * math.ceil(n_heads / s) < n_heads]


def prefix_offsets(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Each head's first row: int64 exclusive prefix sums of its bucket
    sizes (the one spelling of it in the package)."""
    counts = np.asarray(sizes, dtype=np.int64)
    out = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def shard_rows(bucket_sizes: Sequence[int], num_shards: int, rank: int) -> ShardInfo:
    """A contiguous, near-even row range of the layer's table (any count up to
    the number of rows); head_start/head_end are the heads it overlaps."""
    _check_shard_args(bucket_sizes, num_shards, rank)
    total = int(sum(bucket_sizes))
    if num_shards > total:
        raise TopologyError(f"{num_shards} row-wise shards of a table with {total} rows")
    row_start, row_end = rank * total // num_shards, (rank + 1) * total // num_shards
    bounds = np.cumsum([0, *bucket_sizes])
    head_start = int(np.searchsorted(bounds, row_start, side="right") - 1)
    head_end = int(np.searchsorted(bounds, row_end, side="left"))
    return ShardInfo(head_start, head_end, row_start, row_end, row_end - row_start)


def locate_rows(bucket_sizes: Sequence[int], num_shards: int,
                hash_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise lookup mapping: per-head bucket ids ``[..., n_heads]`` ->
    (owning shard, row inside that shard).  DEAD ids map to (-1, -1)."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    sizes = np.asarray(bucket_sizes, dtype=np.int64)
    if ids.shape[-1] != len(sizes):
        raise TopologyError(f"hash ids have {ids.shape[-1]} columns, the layer has "
                            f"{len(sizes)} heads")
    offsets = prefix_offsets(sizes)
    total = int(sizes.sum())
    rows = ids + offsets
    # shard s holds [s*total//n, (s+1)*total//n): invert with integer math
    shard = (rows * num_shards + num_shards - 1) // total
    starts = shard * total // num_shards
    shard = np.where(starts > rows, shard - 1, shard)
    local = rows - shard * total // num_shards
    dead = ids == DEAD_ID
    return np.where(dead, -1, shard), np.where(dead, -1, local)


# ------------------------------------------------------- modes and groups --

@dataclass(frozen=True)
class WorldLayout:
    """TP x DP ranks, TP-minor (global rank = dp_rank * tp + tp_rank), on
    hosts of ``gpus_per_host`` GPUs ("node" elsewhere in this library means a
    NUMA node)."""

    tp: int
    dp: int
    gpus_per_host: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or self.gpus_per_host < 1:
            raise TopologyError(f"tp, dp and gpus_per_host must be >= 1: {self}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def rank(self, tp_rank: int, dp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of {self.world_size}")
        return rank % self.tp, rank // self.tp

    def host_of(self, rank: int) -> int:
        """Index of the host (machine) ``rank`` runs on."""
        return rank // self.gpus_per_host

    def edp_size(self) -> int:
        """Size of a node-local sharing group: gcd(dp, replicas per node) when
        replicas align with node boundaries, else 1."""
        if self.gpus_per_host % self.tp:
            return 1
        return math.gcd(self.dp, self.gpus_per_host // self.tp)

    def edp_group(self, rank: int, socket_of: Sequence[int] | None = None) -> tuple[int, ...]:
        """Ranks sharing one table with ``rank``: node-local DP peers with the
        same TP rank (ranks tp_rank + r*tp).  With ``socket_of`` (the NUMA
        node of each rank's GPU) only peers on rank's socket: one copy per
        socket, the replicate-per-node layout, with no remote reads."""
        tp_rank, dp_rank = self.coords(rank)
        size = self.edp_size()
        first = dp_rank // size * size
        members = tuple(self.rank(tp_rank, d) for d in range(first, first + size))
        if len({self.host_of(m) for m in members}) != 1:
            return (rank,)
        if socket_of is not None:
            if len(socket_of) != self.world_size:
                raise TopologyError(f"socket_of names {len(socket_of)} ranks, the world has "
                                    f"{self.world_size}")
            members = tuple(m for m in members if socket_of[m] == socket_of[rank])
        return members

    def edp_groups(self, socket_of: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        seen, out = set(), []
        for r in range(self.world_size):
            g = self.edp_group(r, socket_of)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out


@dataclass(frozen=True)
class ModeAssignment:
    """What one rank holds and reads under a mode."""

    mode: str
    rank: int
    tp_rank: int
    dp_rank: int
    num_shards: int
    shard_index: int
    embedding_dp_size: int  # EDP size the lookup path uses (1 unless dp_sharded)
    sharing_group: tuple[int, ...]  # ranks that map the same physical copy
    edp_rank: int = 0


def assign(mode: str, layout: WorldLayout, rank: int) -> ModeAssignment:
    if mode not in SHARING_MODES:
        raise TopologyError(f"unknown mode {mode!r}; choose one of {list(SHARING_MODES)}")
    tp_rank, dp_rank = layout.coords(rank)
    group = layout.edp_group(rank)
    if mode == "independent":
        return ModeAssignment(mode, rank, tp_rank, dp_rank, layout.tp, tp_rank, 1, (rank,))
    if mode == "dp_shared":
        return ModeAssignment(mode, rank, tp_rank, dp_rank, layout.tp, tp_rank, 1, group)
    edp, edp_rank = len(group), group.index(rank)
    return ModeAssignment(mode, rank, tp_rank, dp_rank, layout.tp * edp,
                          tp_rank * edp + edp_rank, edp, (rank,), edp_rank)
