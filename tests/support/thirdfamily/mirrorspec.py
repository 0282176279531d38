"""The mirror family's spec and family object (what ``model/<x>.py`` holds)."""

from __future__ import annotations

import dataclasses
from typing import Any

from numa_engram.model.families import EngramFamily
from numa_engram.model.sharding import ShardInfo
from numa_engram.model.spec import EngramSpec

MARKER = "mirror_tables"  # config.json's field naming this family's tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class MirrorSpec(EngramSpec):
    """Engram's geometry under another type: the family is told by type."""

    @classmethod
    def of(cls, spec: EngramSpec) -> MirrorSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


class MirrorFamily(EngramFamily):
    name, title, spec_type = "mirror", "Mirror", MirrorSpec
    reader = "tests.support.thirdfamily.mirrorcheckpoint:READER"
    table = "tests.support.thirdfamily.mirrortable:MirrorTable"
    directory = "tests.support.thirdfamily.mirrormodeldir:MirrorModelDirectory"

    def matches_config(self, doc: object) -> bool:
        return isinstance(doc, dict) and bool(doc.get(MARKER))

    def spec_of_config(self, doc: dict) -> MirrorSpec:
        return MirrorSpec.of(super().spec_of_config(doc))

    def table_name(self, fingerprint: bytes, layer_id: int, shard: ShardInfo,
                   page_size: int, node: str) -> str:
        return "mirror-" + super().table_name(fingerprint, layer_id, shard, page_size, node)

    def sharding_notes(self, spec: Any, world: Any) -> list[str]:
        return [f"mirror rows: {line}" for line in super().sharding_notes(spec, world)]


MIRROR = MirrorFamily()
