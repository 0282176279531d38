"""numa_engram: NUMA-placed, DP-shared host-memory Engram tables.

Importing the package is cheap: torch is imported only by the modules that
need it (fp8, lookup, table, prefetch, cuda), when first used.
"""

from __future__ import annotations

import logging
from importlib import import_module

from ._version import __version__
from .errors import (
    CapacityError,
    CheckpointError,
    CudaError,
    CudaUnavailable,
    GroupTimeout,
    LookupIdError,
    MemberFailure,
    NumaEngramError,
    PlacementError,
    PrefetchError,
    SpecError,
    SpecMismatchError,
    StorageError,
    SyscallError,
    TopologyError,
)
from .hashing import compress_ids, ngram_hashes
from .placement import PlacementPlan, PlacementRange, PlacementReport, plan_placement
from .sharding import DEAD_ID, ShardInfo, WorldLayout, shard_heads, shard_rows
from .spec import EngramSpec
from .topology import Topology

_LAZY = {
    "dequantize_rows": "fp8",
    "quantize_rows": "fp8",
    "SharedEngramTable": "table",
    "PrefetchScheduler": "prefetch",
    "lookup_rows": "lookup",
    "DPShardedLookup": "exchange",
    "HashState": "hashstate",
    "build_token_map": "tokenmap",
    "ShardedHeads": "exchange",
}


# the library only logs; the application decides where logs go
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'numa_engram' has no attribute {name!r}")


__all__ = [
    "__version__", "DEAD_ID", "CapacityError", "CheckpointError", "CudaError", "CudaUnavailable",
    "EngramSpec",
    "GroupTimeout", "LookupIdError", "MemberFailure", "NumaEngramError", "PlacementError",
    "PlacementPlan", "PlacementRange", "PlacementReport", "PrefetchError", "ShardInfo",
    "SpecError", "SpecMismatchError", "StorageError", "SyscallError", "Topology",
    "TopologyError", "WorldLayout", "compress_ids", "ngram_hashes", "plan_placement",
    "shard_heads", "shard_rows", *_LAZY,
]
