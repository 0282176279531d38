"""The table class of a spec's family (``model.families.Family.table``), as
the table service makes one TP shard: mode independent, no group.  The
service asks the spec's family and never tests a spec's type."""

from __future__ import annotations

from typing import Any

from ..errors import SpecError
from ..model.families import family_of
from ..model.sharding import ShardInfo
from .familytable import FamilyTable
from .request import TableOptions


def table_class_of(spec: object) -> type[FamilyTable]:
    """The table class of the spec's family."""
    family = family_of(spec)
    table = family.part("table")
    if not (isinstance(table, type) and issubclass(table, FamilyTable)):
        raise SpecError(f"the {family.title} family's table {family.table!r} is not a "
                        "FamilyTable subclass (numa_engram.tables.familytable)")
    return table


def create_shard(spec: Any, layer_id: int, shard: ShardInfo, checkpoint: Any,
                 options: TableOptions) -> FamilyTable:
    """The table of ``shard`` (the rows the family gives a TP rank), made
    alone (mode independent) by the spec's family's table class."""
    return table_class_of(spec).create_shard(spec, layer_id, shard, checkpoint=checkpoint,
                                             options=options)
