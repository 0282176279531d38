"""A table family's checkpoint reader, as the create protocol and the
loaders use it: resolve a layer once (a plan), copy a row range of it into
a table, finish the table (a fixed region such as PLE's scale).  Each
family names its reader (``model.families.Family.reader``, e.g.
``checkpoint.READER``); the callers ask ``reader_of(spec)`` and never test a
plan's or a spec's type."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SpecError
from ..model.families import family_of

if TYPE_CHECKING:
    from ..model.sharding import ShardInfo
    from ..store.storage import BackingFile

ChunkDone = Callable[[int, int], None]


class CheckpointReader:
    """One family's reader; ``plan_type`` is what ``resolve`` returns;
    ``names``: the family's own tensor naming (Engram's ``TensorNames``)."""

    plan_type: type

    def resolve(self, paths: Any, spec: Any, layer_id: int,
                names: Any = None) -> Any:
        """The layer's tensors in a checkpoint (a file, files, a directory,
        or a plan already resolved, passed through); headers only."""
        if isinstance(paths, self.plan_type):
            return paths
        return self._resolve(paths, spec, layer_id, names)

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: Any) -> Any:
        raise NotImplementedError

    def load(self, backing: BackingFile, plan: Any, spec: Any, layer_id: int,
             shard: ShardInfo, part: tuple[int, int], names: Any, *,
             progress: ChunkDone, threads: int, cpus: Sequence[int]) -> None:
        """Copy the shard's rows ``part`` (shard-relative) from the plan."""
        raise NotImplementedError

    def finish(self, backing: BackingFile, plan: Any) -> None:
        """What the leader writes once besides the rows (nothing by default)."""


def reader_of(spec: object) -> CheckpointReader:
    """The checkpoint reader of the spec's family."""
    family = family_of(spec)
    reader = family.part("reader")
    if not isinstance(reader, CheckpointReader):
        raise SpecError(f"the {family.title} family's reader {family.reader!r} is "
                        f"{type(reader).__name__}, not a CheckpointReader instance")
    return reader
