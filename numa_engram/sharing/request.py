"""One ``SharedEngramTable.create`` call as a frozen request, checked once.

What can be checked without the group is checked here, in the calling
member, before any collective: the mode, the shard, the page size, the
thread counts and the timeout.  What depends on the member's host (its
huge-page mount, its GPU, whether its placement is valid there) is checked
in the join step instead, so a member that fails it fails the whole group
at once rather than leaving the others waiting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from ..bindings import native
from ..errors import SpecError
from ..host import hugepages
from ..host.topology import Topology
from ..literals import CREATE_MODES, CreateMode, PageSize
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..model.spec import strict_int
from ..store.fileformat import Layout, ShardKey
from ..store.placement import PlacementPlan
from .checkpoint import Progress, TensorNames

DEFAULT_POLICY = "gpu-local"
# a load copies with at most this many threads by default: more saturate
# neither the checkpoint's reads nor the node's memory bandwidth further
MAX_DEFAULT_LOAD_THREADS = 8


def table_layout(spec: TableFamily, shard: ShardInfo,
                 page_size: int = native.PAGE_SIZE) -> Layout:
    """The table file's regions for one shard: each row region of the
    family (Engram: FP8 rows, then their scales), then its fixed bytes."""
    return Layout.of([(name, shard.num_rows * width) for name, width in spec.row_regions()]
                     + list(spec.fixed_regions()), page_size)


def shard_key(layer_id: int, shard: ShardInfo) -> ShardKey:
    return ShardKey(layer_id, shard.head_start, shard.head_end, shard.row_start, shard.row_end)


def check_shard(spec: TableFamily, layer_id: int, shard: ShardInfo) -> None:
    spec.check_shard(layer_id, shard)


def default_load_threads() -> int:
    return max(1, min(MAX_DEFAULT_LOAD_THREADS, len(os.sched_getaffinity(0))))


def _positive_seconds(value: Any, name: str = "timeout_s") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SpecError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _shared_load(shared: bool | None) -> bool:
    """Whether the load is split over the members (the default; one name,
    one meaning: ``load_threads`` only counts threads)."""
    return True if shared is None else bool(shared)


def _load_threads(value: Any) -> int:
    if value is None:
        return default_load_threads()
    threads = strict_int(value, "load_threads")
    if threads < 1:
        raise SpecError(f"load_threads must be >= 1 (1: a single-thread copy, no cooperative "
                        f"load) or None (one per CPU, at most {MAX_DEFAULT_LOAD_THREADS}), got "
                        f"{value!r}")
    return threads


@dataclass(frozen=True)
class CreateRequest:
    """What one member asks ``create`` for, every argument checked and in
    its final form (the page size in bytes, the load threads counted, the
    topology detected)."""

    spec: TableFamily  # EngramSpec or PLESpec
    layer_id: int
    shard: ShardInfo
    mode: CreateMode
    placement: str | PlacementPlan | None
    directory: str | None  # as asked; None: an anonymous memfd (a private copy)
    page_size: int
    checkpoint: Any
    names: TensorNames | None
    register_device: int | None
    timeout_s: float
    topology: Topology
    progress: Progress | None
    lookup_threads: int | None  # None: the table picks (default_lookup_threads)
    load_threads: int
    shared_load: bool  # the members on the rows' node load parts (False: the leader alone)
    stall_timeout_s: float  # how long a load may make no progress before it fails

    @classmethod
    def of(cls, spec: TableFamily, layer_id: int, shard: ShardInfo, *, mode: str,
           placement: str | PlacementPlan | None, directory: str | None,
           page_size: PageSize | int, checkpoint: Any, names: TensorNames | None,
           register_device: int | None, timeout_s: float, topology: Topology | None,
           progress: Progress | None, lookup_threads: int | None,
           load_threads: int | None, shared_load: bool | None = None,
           stall_timeout_s: float | None = None) -> CreateRequest:
        if mode not in CREATE_MODES:
            raise SpecError(f"mode must be one of {CREATE_MODES}, got {mode!r}")
        check_shard(spec, layer_id, shard)
        return cls(spec, layer_id, shard, mode,  # type: ignore[arg-type]  # checked above
                   placement, directory, hugepages.parse_page_size(page_size), checkpoint,
                   names, register_device, _positive_seconds(timeout_s),
                   topology or Topology.detect(), progress,
                   None if lookup_threads is None else max(1, int(lookup_threads)),
                   _load_threads(load_threads), _shared_load(shared_load),
                   _positive_seconds(timeout_s if stall_timeout_s is None else stall_timeout_s,
                                     "stall_timeout_s"))

    @property
    def layout(self) -> Layout:
        return table_layout(self.spec, self.shard, self.page_size)

    @property
    def key(self) -> ShardKey:
        return shard_key(self.layer_id, self.shard)

    def private(self) -> CreateRequest:
        """The same request for a copy of this member's own (the fallback of
        ``auto``): no path, an anonymous memfd, never in /dev/shm."""
        return replace(self, directory=None)
