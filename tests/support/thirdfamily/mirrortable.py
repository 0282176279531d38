"""The mirror family's table class (what ``tables/<x>table.py`` holds)."""

from __future__ import annotations

from numa_engram.tables.table import SharedEngramTable

MADE: list[MirrorTable] = []


class MirrorTable(SharedEngramTable):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        MADE.append(self)
