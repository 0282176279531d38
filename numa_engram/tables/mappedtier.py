"""The "mapped" tier: a table whose rows are its checkpoint's own bytes,
mapped read-only from the safetensors files (``mappedfiles``) instead of
copied into a table file (the "resident" tier, ``protocol``).

No copy at start (O(headers) whatever the table's size), one copy per host
in the page cache whatever the number of processes, evictable under
memory pressure (docs/design.md, "Tiers").  So there is nothing to share
or place: every process maps the files itself (``dp_shared`` is the page
cache's already, and refused by name), no NUMA policy binds the page
cache's pages, and CUDA never registers them (pinning evictable pages is
what the tier exists not to do).  A ``MappedBacking`` stands where a
``BackingFile`` stands in a table, with the same surface the tables read
(its regions are uint8 views of the mapped tensors), so every lookup path
runs unchanged over it.  ``MAPPED`` is the tier's entry in ``tiers.TIERS``:
each family's builder, by ``Family.name``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..checkpoints.checkpoint import resolve
from ..checkpoints.familyreaders import reader_of
from ..checkpoints.mappedfiles import MappedArrays, Segment
from ..checkpoints.plecheckpoint import read_scale
from ..errors import SpecError, StorageError
from ..host.topology import Topology, current_node
from ..lookup.cpu import check_hash_ids
from ..model.families import family_of
from ..model.ple import PLESpec
from ..model.sharding import ShardInfo, prefix_offsets
from ..model.spec import EngramSpec
from . import protocol
from .protocol import Built
from .request import CreateRequest, TableOptions, shard_key


@dataclass(frozen=True)
class _Size:
    file_size: int  # the bytes the table's rows span (a table file's field)


class MappedBacking:
    """What a table reads of its backing, for rows mapped from the
    checkpoint: ``region(name)``, ``mapping`` (its address and length),
    ``path``, ``layout.file_size``, ``close()``; no descriptor to hand over.
    ``fixed``: the values of the family's fixed regions (PLE's scale), read
    from the checkpoint (``fixed_region``)."""

    tier = "mapped"
    handover_directory = None

    def __init__(self, arrays: MappedArrays, regions: dict[str, np.ndarray],
                 fixed: dict[str, np.ndarray] | None = None) -> None:
        self.arrays, self._regions, self.fixed = arrays, regions, fixed or {}
        self.mapping = arrays.mapping
        self.path = ", ".join(arrays.identity_paths())
        self.layout = _Size(sum(a.nbytes for a in regions.values()))

    def region(self, name: str) -> np.ndarray:
        if name not in self._regions:
            raise StorageError(f"a mapped table has no {name!r} region of its own: its rows "
                               "are the checkpoint's, read-only, as they are stored there")
        return self._regions[name]

    @property
    def fd(self) -> int:
        raise StorageError("a mapped table has no table file to hand over: its rows are the "
                           "checkpoint's, which every process maps itself (create it with "
                           "tier='mapped' there)")

    def close(self) -> None:
        self._regions = {}
        self.arrays.close()


def mapped_arrays(backing: object) -> MappedArrays | None:
    """The mapped files of a table's backing (None: a resident table's)."""
    return backing.arrays if isinstance(backing, MappedBacking) else None


def fixed_region(backing: Any, name: str) -> np.ndarray:
    """The bytes of a fixed region (PLE's scale): a table file's region, or
    the value a mapped table read from its checkpoint."""
    return backing.fixed[name] if isinstance(backing, MappedBacking) else backing.region(name)


def _check_options(mode: str, checkpoint: Any, options: TableOptions) -> None:
    if checkpoint is None:
        raise SpecError("tier='mapped' reads the rows in place from the checkpoint: pass "
                        "checkpoint= (its directory, file or files)")
    if mode == "dp_shared":
        raise SpecError("mode='dp_shared' does not apply to tier='mapped': the page cache holds "
                        "one copy of the checkpoint's pages for every process that maps it, "
                        "so each maps the files itself; pass mode='auto' or 'independent'")
    if options.register_device is not None:
        raise StorageError(
            f"register_device={options.register_device} with tier='mapped': a mapped table's "
            "pages are the page cache's, which the kernel may evict, so CUDA cannot register "
            "(pin) them; look up on the CPU (its rows go to the GPU from your pinned "
            "buffers), or use tier='resident' for zero-copy GPU reads")
    if options.placement is not None:
        raise SpecError(f"placement={options.placement!r} with tier='mapped': the page cache "
                        "places a file's pages, no memory policy of a table does; leave "
                        "placement unset or use tier='resident'")
    if options.page_size not in ("4K", 4096):
        raise SpecError(f"page_size={options.page_size!r} with tier='mapped': a file's pages "
                        "in the page cache are 4 KiB; use tier='resident' for huge pages")


def _built(backing: MappedBacking, spec: Any, layer_id: int, shard: ShardInfo,
           topology: Topology | None, started: float) -> Built:
    here = current_node(topology or Topology.detect())
    # (a Built holds a BackingFile; a MappedBacking has the surface tables read of one)
    return protocol.attached(cast(Any, backing), "mapped", spec.fingerprint,
                             shard_key(layer_id, shard), here, None,
                             {"map": time.perf_counter() - started})


def engram_mapped(spec: EngramSpec, layer_id: int, shard: ShardInfo, mode: str, checkpoint: Any,
                  options: TableOptions) -> Built:
    """An Engram shard's weights and scales mapped from the checkpoint."""
    _check_options(mode, checkpoint, options)
    started = time.perf_counter()
    plan = resolve(checkpoint, spec, layer_id, options.names)
    a, n = shard.row_start, shard.num_rows
    arrays = MappedArrays({
        "weights": [Segment(plan.weights, a * spec.head_dim, n * spec.head_dim)],
        "scales": [Segment(plan.scales, a * spec.scales_per_row, n * spec.scales_per_row)],
    }, f"mapped Engram table layer {layer_id} heads [{shard.head_start}, {shard.head_end})")
    try:
        regions = {name: arrays.array(name) for name in ("weights", "scales")}
        return _built(MappedBacking(arrays, regions), spec, layer_id, shard, options.topology,
                      started)
    except BaseException:
        arrays.close()
        raise


def _ple_segments(plan: Any, spec: PLESpec, shard: ShardInfo) -> list[Segment]:
    """The byte ranges of the parts that hold rows [row_start, row_end), in order."""
    out = []
    for loc, start in zip(plan.parts, plan.starts):
        a, b = max(shard.row_start, start), min(shard.row_end, start + loc.shape[0])
        if a < b:
            out.append(Segment(loc, (a - start) * spec.row_bytes, (b - a) * spec.row_bytes))
    return out


def ple_mapped(spec: PLESpec, layer_id: int, shard: ShardInfo, mode: str, checkpoint: Any,
               options: TableOptions) -> Built:
    """A PLE shard's rows mapped from vLLM's split-parts checkpoint (the
    parts it spans must lie end to end, or meet at page boundaries), the
    per-tensor scale read from its file as the table's fixed ``scale``."""
    _check_options(mode, checkpoint, options)
    started = time.perf_counter()
    plan = reader_of(spec).resolve(checkpoint, spec, layer_id)
    scale = read_scale(plan)
    arrays = MappedArrays({"weights": _ple_segments(plan, spec, shard)},
                          f"mapped PLE table layer {layer_id} rows [{shard.row_start}, "
                          f"{shard.row_end})")
    try:
        regions = {"weights": arrays.array("weights")}
        fixed = {} if scale is None else {"scale": np.frombuffer(np.float32(scale).tobytes(),
                                                                 dtype=np.uint8)}
        return _built(MappedBacking(arrays, regions, fixed), spec, layer_id, shard,
                      options.topology, started)
    except BaseException:
        arrays.close()
        raise


# (spec, layer, shard, mode, checkpoint, checked options) -> the member's table
Builder = Callable[[Any, int, ShardInfo, str, Any, TableOptions], Built]


class MappedTier:
    """``tier="mapped"`` (``tiers.TIERS``): each family's shard mapped from
    its checkpoint, by ``Family.name``.  Not collective: every process maps
    the files itself, so the group is not asked."""

    builders: dict[str, Builder] = {"engram": engram_mapped, "ple": ple_mapped}

    def build(self, group: Any, req: CreateRequest) -> Built:  # noqa: ARG002
        family = family_of(req.spec)
        if family.name not in self.builders:
            raise SpecError(f"tier='mapped' holds no {family.title} tables yet; use "
                            "tier='resident'")
        return self.builders[family.name](req.spec, req.layer_id, req.shard, req.mode,
                                          req.checkpoint, req.options)


MAPPED = MappedTier()


def engram_rows(spec: EngramSpec, layer_id: int, shard: ShardInfo, ids: Any,
                id_base: np.ndarray | None) -> np.ndarray:
    """The shard rows ``ids [T, n_hash_cols]`` name (the shard's head
    columns; DEAD and out-of-range ids dropped: the lookup refuses those),
    unique and ascending; ids a lookup refuses are its LookupIdError."""
    sizes = np.asarray(spec.bucket_sizes(layer_id)[shard.head_start:shard.head_end],
                       dtype=np.int64)
    cols = check_hash_ids(ids, spec.n_hash_cols)[:, shard.head_start:shard.head_end]
    bucket = cols - id_base if id_base is not None else cols
    ok = (cols != -1) & (bucket >= 0) & (bucket < sizes)
    return np.unique((bucket + prefix_offsets(sizes))[ok])
