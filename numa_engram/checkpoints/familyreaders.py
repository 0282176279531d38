"""Each table family's checkpoint reader, as the create protocol and the
loaders use it: resolve a layer once (a plan), copy a row range of it into
a table, finish the table (a fixed region such as PLE's scale).  Keyed by
``model.families.Family.name``: the callers ask the spec's family and never
test a plan's or a spec's type."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import SpecError
from ..model.families import family_of
from ..model.sharding import ShardInfo
from ..store.storage import BackingFile
from .checkpoint import CheckpointPlan, TensorNames, load_rows
from .checkpoint import resolve as resolve_engram
from .plecheckpoint import PLECheckpointPlan, load_ple_rows, read_scale, resolve_ple

ChunkDone = Callable[[int, int], None]


class CheckpointReader:
    """One family's reader; ``plan_type`` is what ``resolve`` returns."""

    plan_type: type

    def resolve(self, paths: Any, spec: Any, layer_id: int,
                names: TensorNames | None = None) -> Any:
        """The layer's tensors in a checkpoint (a file, files, a directory,
        or a plan already resolved, passed through); headers only."""
        if isinstance(paths, self.plan_type):
            return paths
        return self._resolve(paths, spec, layer_id, names)

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: TensorNames | None) -> Any:
        raise NotImplementedError

    def load(self, backing: BackingFile, plan: Any, spec: Any, layer_id: int,
             shard: ShardInfo, part: tuple[int, int], names: TensorNames | None, *,
             progress: ChunkDone, threads: int, cpus: Sequence[int]) -> None:
        """Copy the shard's rows ``part`` (shard-relative) from the plan."""
        raise NotImplementedError

    def finish(self, backing: BackingFile, plan: Any) -> None:
        """What the leader writes once besides the rows (nothing by default)."""


class EngramReader(CheckpointReader):
    plan_type = CheckpointPlan

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: TensorNames | None) -> CheckpointPlan:
        return resolve_engram(paths, spec, layer_id, names)

    def load(self, backing: BackingFile, plan: Any, spec: Any, layer_id: int,
             shard: ShardInfo, part: tuple[int, int], names: TensorNames | None, *,
             progress: ChunkDone, threads: int, cpus: Sequence[int]) -> None:
        a, b = part
        w = backing.region("weights").reshape(shard.num_rows, spec.head_dim)[a:b]
        s = backing.region("scales").reshape(shard.num_rows, spec.scales_per_row)[a:b]
        load_rows(plan, spec, layer_id, shard.row_start + a, shard.row_start + b, w, s,
                  names=names, progress=progress, threads=threads, cpus=cpus)


class PLEReader(CheckpointReader):
    plan_type = PLECheckpointPlan
    # (load's layer_id and names are Engram's: a PLE plan is one layer's, named by vLLM)

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: TensorNames | None) -> PLECheckpointPlan:  # noqa: ARG002 (Engram's)
        return resolve_ple(paths, spec, layer_id)  # vLLM's own tensor names

    def load(self, backing: BackingFile, plan: Any, spec: Any, layer_id: int,  # noqa: ARG002
             shard: ShardInfo, part: tuple[int, int],
             names: TensorNames | None, *,  # noqa: ARG002
             progress: ChunkDone, threads: int, cpus: Sequence[int]) -> None:
        a, b = part
        out = backing.region("weights").reshape(shard.num_rows, spec.row_bytes)[a:b]
        load_ple_rows(plan, spec, shard.row_start + a, shard.row_start + b, out,
                      threads=threads, progress=progress, cpus=cpus)

    def finish(self, backing: BackingFile, plan: Any) -> None:
        """The per-tensor scale into its fixed region (the leader's mapping
        is writable until the table is sealed)."""
        scale = read_scale(plan)
        if scale is not None:
            backing.region("scale")[:4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)


READERS: dict[str, CheckpointReader] = {"engram": EngramReader(), "ple": PLEReader()}


def reader_of(spec: object) -> CheckpointReader:
    """The checkpoint reader of the spec's family."""
    name = family_of(spec).name
    if name not in READERS:
        raise SpecError(f"no checkpoint reader for {family_of(spec).title} tables")
    return READERS[name]
