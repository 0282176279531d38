"""The mirror family's model directory (what ``runtime/<x>modeldir.py`` holds)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from numa_engram.runtime.modeldir import ModelDirectory

from .mirrorspec import MirrorSpec


@dataclasses.dataclass(frozen=True)
class MirrorModelDirectory(ModelDirectory):
    @classmethod
    def open(cls, path: str | os.PathLike, tokenizer: Any = None) -> MirrorModelDirectory:
        engram = ModelDirectory.open(path, tokenizer)
        return cls(engram.path, engram.config, MirrorSpec.of(engram.spec), engram.token_map,
                   engram.dead_ids)
