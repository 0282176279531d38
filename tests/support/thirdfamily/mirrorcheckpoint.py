"""The mirror family's checkpoint reader (what ``checkpoints/<x>checkpoint.py``
holds): Engram's tensors, its calls counted."""

from __future__ import annotations

from typing import Any

from numa_engram.checkpoints.checkpoint import EngramReader

CALLS = {"resolve": 0, "load": 0}


class MirrorReader(EngramReader):
    def _resolve(self, paths: Any, spec: Any, layer_id: int, names: Any) -> Any:
        CALLS["resolve"] += 1
        return super()._resolve(paths, spec, layer_id, names)

    def load(self, *args: Any, **kwargs: Any) -> None:
        CALLS["load"] += 1
        super().load(*args, **kwargs)


READER = MirrorReader()
