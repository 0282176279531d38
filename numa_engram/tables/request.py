"""One ``SharedEngramTable.create`` call as a frozen request, checked once.

What can be checked without the group is checked here, in the calling
member, before any collective: the mode, the shard, the page size, the
thread counts and the timeout.  What depends on the member's host (its
huge-page mount, its GPU, whether its placement is valid there) is checked
in the join step instead, so a member that fails it fails the whole group
at once rather than leaving the others waiting.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

from ..bindings import native
from ..checkpoints.checkpoint import Progress, TensorNames
from ..errors import SpecError
from ..host import hugepages
from ..host.topology import Topology
from ..literals import CREATE_MODES, DEFAULT_DIRECTORY, CreateMode, PageSize
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..model.spec import strict_int
from ..store.fileformat import Layout, ShardKey
from ..store.placement import PlacementPlan

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


def positive_seconds(value: Any, name: str = "timeout_s") -> float:
    """``value`` as a bound on a wait: a finite number of seconds > 0 (a
    SpecError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise SpecError(f"{name} must be a finite number of seconds > 0, got {value!r}")
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
class TableOptions:
    """How a table is made, whatever its layer and shard: ``create``'s
    keywords as one object, for a caller that makes many tables alike (a
    runtime's layers, the vLLM plugin, the table service).  Each field is
    the ``create`` keyword of its name; ``create`` checks them."""

    placement: str | PlacementPlan | None = None
    directory: str | None = DEFAULT_DIRECTORY
    page_size: PageSize | int = "4K"
    register_device: int | None = None
    timeout_s: float = 300.0
    topology: Topology | None = None
    names: TensorNames | None = None
    progress: Progress | None = None
    lookup_threads: int | None = None
    load_threads: int | None = None
    shared_load: bool | None = None
    stall_timeout_s: float | None = None

    def given_once(self, options: TableOptions | None) -> TableOptions:
        """``options`` when given (these, from keywords, left at their
        defaults), else these."""
        if options is None:
            return self
        given = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
        if given:
            raise TypeError(f"{', '.join(given)} given both as keyword(s) and in options=; "
                            "give each table option one way")
        return options


@dataclass(frozen=True)
class CreateRequest:
    """What one member asks ``create`` for: the table (spec, layer, shard),
    the mode and checkpoint, and its options checked and in their final
    form (the page size in bytes, the load threads counted, the topology
    detected): ``options`` is what the protocol reads."""

    spec: TableFamily  # EngramSpec or PLESpec
    layer_id: int
    shard: ShardInfo
    mode: CreateMode
    checkpoint: Any
    options: TableOptions

    @classmethod
    def of(cls, spec: TableFamily, layer_id: int, shard: ShardInfo, mode: str, checkpoint: Any,
           options: TableOptions) -> CreateRequest:
        if mode not in CREATE_MODES:
            raise SpecError(f"mode must be one of {CREATE_MODES}, got {mode!r}")
        check_shard(spec, layer_id, shard)
        o = options
        checked = replace(
            o, page_size=hugepages.parse_page_size(o.page_size),
            timeout_s=positive_seconds(o.timeout_s), topology=o.topology or Topology.detect(),
            lookup_threads=None if o.lookup_threads is None else max(1, int(o.lookup_threads)),
            load_threads=_load_threads(o.load_threads), shared_load=_shared_load(o.shared_load),
            stall_timeout_s=positive_seconds(
                o.timeout_s if o.stall_timeout_s is None else o.stall_timeout_s,
                "stall_timeout_s"))
        return cls(spec, layer_id, shard, mode, checkpoint,  # type: ignore[arg-type]  # checked
                   checked)

    # the checked options whose type of() narrowed (a page size in bytes,
    # the rest never None), as their types
    @property
    def page_size(self) -> int:
        assert isinstance(self.options.page_size, int)
        return self.options.page_size

    @property
    def topology(self) -> Topology:
        assert self.options.topology is not None
        return self.options.topology

    @property
    def load_threads(self) -> int:
        assert self.options.load_threads is not None
        return self.options.load_threads

    @property
    def shared_load(self) -> bool:
        assert self.options.shared_load is not None
        return self.options.shared_load

    @property
    def stall_timeout_s(self) -> float:
        assert self.options.stall_timeout_s is not None
        return self.options.stall_timeout_s

    @property
    def layout(self) -> Layout:
        return table_layout(self.spec, self.shard, self.page_size)

    @property
    def key(self) -> ShardKey:
        return shard_key(self.layer_id, self.shard)

    def private(self) -> CreateRequest:
        """The same request for a copy of this member's own (the fallback of
        ``auto``): no path, an anonymous memfd, never in /dev/shm."""
        return replace(self, options=replace(self.options, directory=None))
