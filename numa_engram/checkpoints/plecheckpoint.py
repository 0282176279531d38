"""Qwen4-Exp PLE tables in safetensors checkpoints: each layer's table split
into ``split_ngram_parts`` row ranges (``...ngram_embedding.shard_{i}.weight``,
part i holding ``PLESpec.part_rows``) and, for FP8, one fp32
``...ngram_embedding.weight_scale``; vLLM's loader copies the parts into
each rank's row range by overlap, and so does ``load_ple_rows``.  The
files themselves (regular files only, headers read once, each file checked
unchanged before and after the load) are ``safetensorsfiles``'s, as for
Engram.  (The synthetic writer: ``checkpoints.synthetic``.)"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from ..model.ple import PLESpec
from ..store.chunks import for_each_chunk
from .familyreaders import CheckpointReader, ChunkDone
from .safetensorsfiles import Header, OpenFiles, TensorLocation, checkpoint_files, locate

if TYPE_CHECKING:
    from ..model.sharding import ShardInfo
    from ..store.storage import BackingFile
    from .checkpoint import TensorNames

# vLLM's module path of a PLE layer's table (``layers.{index}``: the
# 0-based decoder layer, one less than the 1-based ple_layer_ids entry)
PREFIX = "layers.{index}.ple.ple_embedding.ngram_embedding."
MODEL_PREFIXES = ("model.", "model.language_model.", "")
ROW_DTYPES = {"float8_e4m3fn": ("F8_E4M3", "U8"), "bfloat16": ("BF16",)}
RAW_CHUNK = 64 << 20


@dataclass(frozen=True)
class PLECheckpointPlan:
    """A layer's parts (in part order) and scale, resolved once by the
    leader: every loader reads through it."""

    layer_id: int
    parts: tuple[TensorLocation, ...]
    starts: tuple[int, ...]  # the layer row each part begins at
    scale: TensorLocation | None

    @property
    def locations(self) -> list[TensorLocation]:
        return [*self.parts, *([self.scale] if self.scale else [])]


def _name(files: dict[str, str], layer_id: int, leaf: str) -> str | None:
    for prefix in MODEL_PREFIXES:
        name = prefix + PREFIX.format(index=layer_id - 1) + leaf
        if name in files:
            return name
    return None


def resolve_ple(paths: Any, spec: PLESpec, layer_id: int) -> PLECheckpointPlan:
    """The layer's parts and scale in a checkpoint (file, files or
    directory), each name, dtype and shape checked; headers only
    (``familyreaders.reader_of(spec).resolve`` passes a plan through)."""
    return resolve_ple_layers(paths, spec, [layer_id])[layer_id]


def resolve_ple_layers(paths: Any, spec: PLESpec, layer_ids: Sequence[int]
                       ) -> dict[int, PLECheckpointPlan]:
    """``resolve_ple`` for several layers, the index read and each file's
    header parsed once for all of them."""
    files = checkpoint_files(paths)
    headers: dict[str, Header] = {}
    return {layer_id: _resolve_layer(files, headers, spec, layer_id) for layer_id in layer_ids}


def _resolve_layer(files: dict[str, str], headers: dict[str, Header], spec: PLESpec,
                   layer_id: int) -> PLECheckpointPlan:
    parts, starts = [], []
    for part in range(spec.split_ngram_parts):
        start, end = spec.part_rows(layer_id, part)
        name = _name(files, layer_id, f"shard_{part}.weight")
        if name is None:
            found = sorted(n for n in files if f"layers.{layer_id - 1}.ple." in n)[:6]
            want = PREFIX.format(index=layer_id - 1) + f"shard_{part}.weight"
            raise CheckpointError(f"PLE layer {layer_id}: no tensor for part {part} of "
                                  f"{spec.split_ngram_parts} (...{want}); that layer's PLE "
                                  f"tensors: {found or 'none'}")
        loc = locate(files, name, headers)
        _check(loc, ROW_DTYPES[spec.dtype], (end - start, spec.head_dim))
        parts.append(loc)
        starts.append(start)
    scale = None
    if spec.dtype == "float8_e4m3fn":
        name = _name(files, layer_id, "weight_scale")
        if name is None:
            raise CheckpointError(f"PLE layer {layer_id}: the FP8 table has no weight_scale "
                                  "tensor (vLLM refuses such a checkpoint too)")
        scale = locate(files, name, headers)
        if scale.dtype != "F32" or int(np.prod(scale.shape, dtype=np.int64)) != 1:
            raise CheckpointError(f"{scale.name} in {scale.path} is {scale.dtype} "
                                  f"{list(scale.shape)}; a per-tensor scale is one F32")
    return PLECheckpointPlan(layer_id, tuple(parts), tuple(starts), scale)


def _check(loc: TensorLocation, dtypes: tuple[str, ...], shape: tuple[int, int]) -> None:
    if loc.dtype not in dtypes or loc.shape != shape:
        raise CheckpointError(f"{loc.name} in {loc.path} is {loc.dtype} {list(loc.shape)}; the "
                              f"spec says {'/'.join(dtypes)} {list(shape)}")


def read_scale(plan: PLECheckpointPlan) -> float | None:
    """The FP8 table's per-tensor scale (None for BF16), read from the file
    resolved, checked unchanged before and after."""
    if plan.scale is None:
        return None
    data = bytearray(4)
    with OpenFiles([plan.scale]) as files:
        files.read_into(plan.scale, 0, memoryview(data))
        files.check_unchanged("while the scale was read")
    return float(struct.unpack("<f", data)[0])


def load_ple_rows(plan: PLECheckpointPlan, spec: PLESpec, row_start: int, row_end: int,
                  out: np.ndarray, *, threads: int = 1,
                  progress: Callable[[int, int], None] | None = None,
                  cpus: Sequence[int] = ()) -> None:
    """Copy layer rows ``[row_start, row_end)`` into uint8 ``out [n,
    row_bytes]`` from the parts that overlap them, in chunks on
    ``threads`` threads (pinned to ``cpus``).  Each file is opened once and
    every row read through that descriptor; a file that is not what was
    resolved (replaced, truncated or rewritten), before or during the copy,
    is a CheckpointError naming it."""
    width = spec.row_bytes
    if out.shape != (row_end - row_start, width):
        raise CheckpointError(f"destination {out.shape} does not hold rows {row_start}.."
                              f"{row_end} of {width} bytes")
    per_chunk = max(1, RAW_CHUNK // width)
    chunks = []
    for loc, start in zip(plan.parts, plan.starts):
        a, b = max(row_start, start), min(row_end, start + loc.shape[0])
        chunks += [(loc, r - start, min(b, r + per_chunk) - start, r - row_start)
                   for r in range(a, b, per_chunk)]
    with OpenFiles(plan.locations) as files:
        def one(chunk: tuple[TensorLocation, int, int, int]) -> int:
            loc, a, b, at = chunk
            files.read_into(loc, a * width, memoryview(out[at:at + b - a].reshape(-1).data))
            return (b - a) * width

        for_each_chunk(chunks, one, threads=threads, total=out.size, progress=progress,
                       pin_cpus=cpus, name="numa-engram-load")
        files.check_unchanged("while the table loaded")


class PLEReader(CheckpointReader):
    """The PLE family's reader (``model.families.PLEFamily.reader``); a
    plan is one layer's, its tensors named by vLLM (no ``TensorNames``)."""

    plan_type = PLECheckpointPlan

    def _resolve(self, paths: Any, spec: Any, layer_id: int,
                 names: TensorNames | None) -> PLECheckpointPlan:  # noqa: ARG002 (Engram's)
        return resolve_ple(paths, spec, layer_id)

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


READER = PLEReader()
