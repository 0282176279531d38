"""Each table family's table class as a holder of one TP shard makes it
(the table service: mode independent, no group): keyed by
``model.families.Family.name``, so the service asks the spec's family and
never tests a spec's type.  The two classes' own ``create`` differ in how a
shard is named (Engram: a ShardInfo of heads; PLE: an ETP rank and size)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import SpecError
from ..model.families import family_of
from ..model.sharding import ShardInfo
from .familytable import FamilyTable
from .pletable import SharedPLETable
from .request import TableOptions
from .table import SharedEngramTable

AnyTable = FamilyTable  # (every family's table class is one)
# (spec, layer, shard, tp rank, tp, checkpoint, options) -> the table
Create = Callable[[Any, int, ShardInfo, int, int, Any, TableOptions], AnyTable]


def _engram(spec: Any, layer_id: int, shard: ShardInfo, tp_rank: int, tp: int,  # noqa: ARG001
            checkpoint: Any, options: TableOptions) -> AnyTable:
    return SharedEngramTable.create(spec, layer_id, shard, mode="independent",
                                    checkpoint=checkpoint, options=options)


def _ple(spec: Any, layer_id: int, shard: ShardInfo, tp_rank: int, tp: int,  # noqa: ARG001
         checkpoint: Any, options: TableOptions) -> AnyTable:
    return SharedPLETable.create(spec, layer_id, etp_rank=tp_rank, etp_size=tp,
                                 mode="independent", checkpoint=checkpoint, options=options)


CREATORS: dict[str, Create] = {"engram": _engram, "ple": _ple}


def create_shard(spec: Any, layer_id: int, shard: ShardInfo, tp_rank: int, tp: int,
                 checkpoint: Any, options: TableOptions) -> AnyTable:
    """TP rank ``tp_rank``'s table of the layer (``shard``: the rows its
    family gives that rank), made alone (mode independent)."""
    family = family_of(spec)
    if family.name not in CREATORS:
        raise SpecError(f"no table class holds {family.title} tables")
    return CREATORS[family.name](spec, layer_id, shard, tp_rank, tp, checkpoint, options)
