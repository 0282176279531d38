"""numa_engram: NUMA-placed, DP-shared host-memory Engram tables.

Importing the package is cheap: torch is imported only by the modules that
need it (fp8, lookup, table, prefetch, cuda), when first used.

The folders are the layers, each importing only those below it (see
CONTRIBUTING.md): ``bindings`` (the C core, the CUDA runtime), ``model``
(spec, sharding, hashes, FP8), ``host`` (/proc, /sys, topology, huge pages,
accounting), ``store`` (file format, backing files, placement, gc),
``lookup`` (CPU, GPU, prefetch), ``groups`` (process groups: torch and
socket), ``checkpoints`` (safetensors readers of each family),
``tables`` (the table base class, the Engram and PLE tables, their create
protocol), ``runtime`` (model directories and ``EngramRuntime``),
``service`` (the table service) and ``cli``.  A table family is one
object (``Family``, ``register_family``): docs/design.md, "Adding a
family".
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

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
    ServiceRefusal,
    SpecError,
    SpecMismatchError,
    StorageError,
    SyscallError,
    TopologyError,
)
from .host.topology import Topology
from .model.hashing import compress_ids, ngram_hashes
from .model.sharding import DEAD_ID, ShardInfo, WorldLayout, shard_heads, shard_rows
from .model.spec import EngramSpec
from .store.placement import PlacementPlan, PlacementRange, PlacementReport, plan_placement

_LAZY = {
    "dequantize_rows": "model.fp8",
    "quantize_rows": "model.fp8",
    "SharedEngramTable": "tables.table",
    "SharedPLETable": "tables.pletable",
    "FamilyTable": "tables.familytable",
    "PLESpec": "model.ple",
    "Family": "model.families",
    "register_family": "model.families",
    "TableOptions": "tables.request",
    "PrefetchScheduler": "lookup.prefetch",
    "lookup_rows": "lookup.cpu",
    "DPShardedLookup": "runtime.dpsharded",
    "HashState": "model.hashstate",
    "build_token_map": "model.tokenmap",
    "ShardedHeads": "runtime.dpsharded",
    "sharing_groups": "groups.group",
    "as_group": "groups.group",
    "SocketGroup": "groups.socketgroup",
    "EngramRuntime": "runtime.engramruntime",
    "ModelDirectory": "runtime.modeldir",
    "write_synthetic_model": "runtime.modeldir",
    "write_synthetic_checkpoint": "checkpoints.synthetic",
    "TensorNames": "checkpoints.checkpoint",
}

if TYPE_CHECKING:  # what _LAZY gives, as the real names for type checkers
    from .checkpoints.checkpoint import TensorNames
    from .checkpoints.synthetic import write_synthetic_checkpoint
    from .groups.group import as_group, sharing_groups
    from .groups.socketgroup import SocketGroup
    from .lookup.cpu import lookup_rows
    from .lookup.prefetch import PrefetchScheduler
    from .model.families import Family, register_family
    from .model.fp8 import dequantize_rows, quantize_rows
    from .model.hashstate import HashState
    from .model.ple import PLESpec
    from .model.tokenmap import build_token_map
    from .runtime.dpsharded import DPShardedLookup, ShardedHeads
    from .runtime.engramruntime import EngramRuntime
    from .runtime.modeldir import ModelDirectory, write_synthetic_model
    from .tables.familytable import FamilyTable
    from .tables.pletable import SharedPLETable
    from .tables.request import TableOptions
    from .tables.table import SharedEngramTable

# the library only logs; the application decides where logs go
logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'numa_engram' has no attribute {name!r}")


__all__ = [
    "__version__", "DEAD_ID", "CapacityError", "CheckpointError", "CudaError", "CudaUnavailable",
    "DPShardedLookup", "EngramRuntime", "EngramSpec", "GroupTimeout", "HashState",
    "LookupIdError", "MemberFailure", "ModelDirectory", "NumaEngramError", "PlacementError",
    "PlacementPlan", "PlacementRange", "PlacementReport", "PrefetchError", "PrefetchScheduler",
    "ShardInfo", "ServiceRefusal", "SharedEngramTable", "ShardedHeads", "SpecError",
    "SpecMismatchError", "StorageError", "SyscallError", "Topology", "TopologyError",
    "WorldLayout", "as_group", "build_token_map", "compress_ids", "dequantize_rows",
    "lookup_rows", "ngram_hashes", "plan_placement", "quantize_rows", "shard_heads", "shard_rows",
    "sharing_groups", "write_synthetic_model", "TensorNames", "write_synthetic_checkpoint",
    "TableOptions", "SocketGroup", "SharedPLETable", "FamilyTable", "PLESpec", "Family",
    "register_family",
]
assert set(_LAZY) <= set(__all__)
